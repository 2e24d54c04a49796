"""hvdnb's Jupyter-side pieces that are not the library itself.

- ``kernels_ext.engine``: the engine-side extension (bootstrap + cell runner) that hvdnb
  starts under mpiexec in place of a bare ``ipengine``.
- ``kernels_ext.kernelspec``: the "Python 3 (hvdnb)" kernelspec, built by code.
"""
