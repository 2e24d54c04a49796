"""Code that runs on ranks only: engine bootstrap, side channel, rendezvous, the recorder.

Never imports ``hvdnb.notebook`` or ``hvdnb.torch``: ``hvdnb.torch`` (an API over this runtime)
registers into the hooks this side owns (``hvdnb.rank.hooks``). Imports ``hvdnb.protocol`` and
``hvdnb.config``.
"""
