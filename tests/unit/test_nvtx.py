"""NVTX ranges: emitted only where CUDA is in use; a no-op on CPU that never initialises CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvdnb.host import gpu_count
from hvdnb.rank import nvtx as _nvtx
from tests.conftest import gpu_visible


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
    # in a fresh process: this one hides the GPUs from the CPU tests (tests/conftest.py)
    with gpu_visible():
        if gpu_count() == 0:
            pytest.skip("no CUDA device")
        code = (
            "import torch\nfrom hvdnb.rank import nvtx as _nvtx\n"
            "assert not _nvtx.active()\n"
            "torch.zeros(1, device='cuda')\n"  # CUDA in use
            "assert _nvtx.active()\n"
            "opened = _nvtx.push('cell 1'); assert opened is True; _nvtx.pop(opened)\n"
            "r = _nvtx.start('bucket'); assert r is not None; _nvtx.end(r)\nprint('ok')\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
