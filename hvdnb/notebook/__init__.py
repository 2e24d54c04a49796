"""Code that runs in the notebook kernel only: magics, cells, the cluster, the store, the panel.

Never imported on ranks. Imports ``hvdnb.protocol`` and ``hvdnb.config``, never ``hvdnb.rank``.
"""
