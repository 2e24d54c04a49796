"""A ``%%distributed`` cell, from the notebook's side: what it sends and what comes out.

- ``cells``: sending a cell to the ranks and waiting for it (``run_cell``); its errors
  (``DistributedCellError``); ``cellwait``: the wait's policy (fail fast, interrupt,
  timeout, stall), a state machine without I/O;
- ``streaming``: the ranks' output messages drawn as a local kernel would draw them, with
  ``output`` (the same line from several ranks merged into one tagged line) and
  ``terminal`` (a rank's progress bars drawn on its own screen);
- ``ranklogs``: ``%dist logs``, each rank's own log and what it printed in cells, whole;
- ``automode``: ``%dist auto on``, every cell on the ranks; ``introspect``: Tab and
  Shift-Tab answered by rank 0.

Never: import the rank side (``hvdnb.rank``), or act on a cluster's processes (the cluster
package does).
"""
