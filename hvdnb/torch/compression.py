"""Gradient compression for the wire: ``Compression.none`` and ``Compression.fp16``.

Owns: compressors (compress before a collective, decompress after). Never: communicate,
or change a tensor the caller still owns (compress returns a new tensor or the same one).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface: ``compress(t) -> (wire_tensor, ctx)``, ``decompress(t, ctx) -> tensor``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (half the bytes on NCCL), restore the dtype.

    On CPU under MPI hvdnb sums half types in float32, so this saves no bandwidth there;
    it only rounds.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor


class Compression:
    """The available compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
