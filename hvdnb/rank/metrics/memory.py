"""Memory readings for the recorder's messages: this process's RSS (psutil) and, when the
training code already uses CUDA, torch's allocated/reserved bytes, NVML's "used" and the
GPU's utilisation (NVML ``utilization.gpu``: percent of the last sample period in which a
kernel ran; ``utilization.memory``: percent of it in which device memory was read or
written, the memory-bandwidth utilisation, as ``nvidia-smi`` reports both).

Sampled with each message (once per flush interval, 0.25-1 s), never per step.

Owns: ``MemorySampler``. Never: import torch (it reads ``sys.modules``), initialise CUDA,
synchronise, or raise (a reading that cannot be taken is left out).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["MemorySampler"]


class MemorySampler:
    """Memory readings at flush time; a reading that cannot be taken is left out (the
    panel shows "n/a"), never reported as 0."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._nvml: Any = None
        self._nvml_tried = False
        try:
            import psutil  # noqa: PLC0415  optional: its ImportError is handled here

            self._proc = psutil.Process()
        except Exception:
            pass

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._proc is not None:
            try:
                out["mem/rss"] = float(self._proc.memory_info().rss)
            except Exception:
                pass
        torch = sys.modules.get("torch")
        if torch is None:
            return out
        try:
            cuda = torch.cuda
            if cuda.is_available() and cuda.is_initialized():
                dev = cuda.current_device()
                out["mem/gpu_allocated"] = float(cuda.memory_allocated(dev))
                out["mem/gpu_reserved"] = float(cuda.memory_reserved(dev))
                h = self._nvml_handle(dev)
                used = self._nvml_used(h)
                if used is not None:
                    out["mem/gpu_nvml_used"] = used
                util = self.gpu_utilization(h)
                if util is not None:
                    out["mem/gpu_util_pct"], out["mem/gpu_membw_util_pct"] = util
        except Exception:
            pass
        return out

    def _nvml_handle(self, dev: int) -> Any:
        """NVML's handle of torch's CUDA device ``dev`` (None without NVML: the ``[gpu]``
        extra, nvidia-ml-py, is not installed, or no driver answers)."""
        if not self._nvml_tried:
            self._nvml_tried = True
            try:
                import pynvml  # noqa: PLC0415  pynvml is optional (the gpu extra)

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:
                self._nvml = None
        if self._nvml is None:
            return None
        try:  # torch's device index counts the visible GPUs; NVML counts all of them
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            index = int(ids[dev]) if dev < len(ids) and ids[dev].isdigit() else dev
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            return None

    def _nvml_used(self, h: Any) -> float | None:
        if h is None:
            return None
        nvml = self._nvml
        v2 = getattr(nvml, "nvmlMemory_v2", None)
        if v2 is not None:
            try:  # "used" as nvidia-smi shows it: the driver's reserve is not in it
                return float(nvml.nvmlDeviceGetMemoryInfo(h, version=v2).used)
            except Exception:  # an older driver: v1, whose "used" counts the reserve
                pass
        try:
            return float(nvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            return None

    def gpu_utilization(self, h: Any) -> tuple[float, float] | None:
        """(``utilization.gpu``, ``utilization.memory``) in percent for NVML handle ``h``;
        None when there is no handle or NVML cannot say (the panel shows "n/a")."""
        if h is None or self._nvml is None:
            return None
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(h)
            return float(rates.gpu), float(rates.memory)
        except Exception:
            return None
