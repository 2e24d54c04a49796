"""The IPython surface of the notebook side: the ``%dist`` and ``%%distributed`` magics
(``magics``), their options and help (``magic_options``), and the hint under a cell's
"No module named ..." (``importhint``). Never: run a cell itself (``cellout``) or start a
cluster (``cluster``): the magics call them."""
