"""Horovod's ``horovod.tensorflow.util`` names that user code and Horovod's suites import.

Owns: ``_executing_eagerly`` (Horovod's spelling). Never: anything else.
"""

from __future__ import annotations

from hvdnb.tensorflow.basics import executing_eagerly as _executing_eagerly

__all__ = ["_executing_eagerly"]
