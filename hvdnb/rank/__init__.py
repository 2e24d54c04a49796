"""Code that runs on ranks only: engine bootstrap, side channel, rendezvous, the recorder.

Never imports ``hvdnb.notebook``. Imports ``hvdnb.protocol``, ``hvdnb.config`` and ``hvdnb.torch``.
"""
