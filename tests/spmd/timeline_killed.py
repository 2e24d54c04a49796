"""Helper for test_spmd.py (not an spmd_* script): record a timeline, then die by SIGKILL.

Single process (a world of one). The test then checks the file is still valid JSON.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import hvdnb.torch as hvd
from hvdnb.torch import timeline

hvd.init()
hvd.start_timeline(sys.argv[1])
timeline._ACTIVE["writer"].flush_interval = 0.0  # flush every event: the worst case for tearing
for i in range(200):
    hvd.allreduce(torch.ones(8), name=f"step.{i}")
print("recorded", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
