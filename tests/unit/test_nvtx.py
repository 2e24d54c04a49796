"""NVTX ranges: emitted only where CUDA is in use; a no-op on CPU that never initialises CUDA."""

from __future__ import annotations

import pytest

from hvdnb import _nvtx


def test_no_range_and_no_cuda_init_on_cpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu tests cover it")
    assert _nvtx.active() is False
    assert _nvtx.push("cell 1") is False
    _nvtx.pop(False)
    assert not torch.cuda.is_initialized()


@pytest.mark.gpu
def test_ranges_are_emitted_with_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.zeros(1, device="cuda")  # CUDA in use
    assert _nvtx.active()
    opened = _nvtx.push("cell 1")
    assert opened is True
    _nvtx.pop(opened)
