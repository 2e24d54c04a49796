"""What the notebook kernel and the ranks both speak: message kinds, the wire, knob rules.

Imported on both sides. Never imports ``hvdnb.notebook`` or ``hvdnb.rank``.
"""
