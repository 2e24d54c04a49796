"""The card's top-level package for the kernel and the engine bootstrap.

- ``kernels_ext.kernelspec``: the "Python 3 (hvdnb)" kernelspec, built by code (notebook
  side); re-exported from ``hvdnb.notebook.headless.kernelspec``, where ``hvdnb run`` finds it.
- ``kernels_ext.autoload``: loaded by that kernel at start; registers ``%dist`` (notebook side).
- ``kernels_ext.engine``: ``python -m kernels_ext.engine``, the command every rank runs; it
  starts ``hvdnb.rank.engine`` (rank side).

One direction: ``kernels_ext`` imports hvdnb; nothing in hvdnb imports ``kernels_ext``.
"""
