"""Horovod's gradient compression for TensorFlow tensors: ``Compression.none`` and
``Compression.fp16`` (floating tensors travel as float16 and come back in their dtype).

Owns: the two compressors. Never: compress integer tensors, or keep state between calls.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """A wire format: ``compress`` before the collective, ``decompress`` after."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor as it is."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Floating tensors as float16 on the wire, cast back afterwards."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and ctx != tensor.dtype:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """``Compression.none`` (default) and ``Compression.fp16``, as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor
