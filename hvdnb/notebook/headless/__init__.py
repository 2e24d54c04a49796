"""The command line and headless runs: the ``hvdnb`` console script (``cli``), a notebook
run in a real kernel without a browser (``runner``), the kernelspec it installs
(``kernelspec``), and the cells that ran, as a script (``export``). Never: imported by the
kernel's own cell path (the magics import ``export`` only for ``%dist export``)."""
