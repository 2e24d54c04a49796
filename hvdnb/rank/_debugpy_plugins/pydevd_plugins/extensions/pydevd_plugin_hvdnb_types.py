"""How JupyterLab's debugger shows a tensor's value on a rank: shape, dtype and device
first (a repr of a large tensor says little and costs a lot), the value when it is one
number."""

from __future__ import annotations

import sys
from typing import Any

from _pydevd_bundle.pydevd_extension_api import StrPresentationProvider

__all__ = ["TensorPresentation"]  # pydevd instantiates each provider class listed here


def describe(val: Any) -> str:
    """``Tensor(64, 784) float32 cpu`` (``= 0.25`` added for a one-element tensor)."""
    shape = ", ".join(str(d) for d in val.shape)
    dtype = str(val.dtype).replace("torch.", "")
    text = f"{type(val).__name__}({shape}) {dtype} {val.device}"
    if val.numel() == 1 and val.device.type != "meta":
        try:
            text += f" = {val.item():.6g}"
        except Exception:
            pass
    if getattr(val, "requires_grad", False):
        text += " requires_grad"
    return text


class TensorPresentation(StrPresentationProvider):  # type: ignore[misc]  # pydevd is untyped
    """torch.Tensor and its subclasses (nn.Parameter): ``describe``."""

    def can_provide(self, type_object: Any, type_name: str) -> bool:
        torch = sys.modules.get("torch")
        return (
            torch is not None
            and isinstance(type_object, type)
            and issubclass(type_object, torch.Tensor)
        )

    def get_str(self, val: Any) -> str:
        return describe(val)
