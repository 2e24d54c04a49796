"""Timeline writer and compression without processes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hvdnb.torch import Compression, merge_timelines
from hvdnb.torch.timeline import TimelineWriter


def test_file_is_valid_json_after_every_flush(tmp_path: Path) -> None:
    w = TimelineWriter(tmp_path / "t.json", pid=3, flush_interval=0.0)
    assert json.loads((tmp_path / "t.json").read_text())[0]["ph"] == "M"
    for i in range(20):
        w.event(f"allreduce.{i}", "allreduce", 1000.0 * i, 5.0, bytes=4)
        events = json.loads((tmp_path / "t.json").read_text())  # never half-written
        assert len(events) == i + 2 and events[-1]["name"] == f"allreduce.{i}"
    w.close()
    assert all(e["pid"] == 3 for e in json.loads((tmp_path / "t.json").read_text()))


def test_buffered_events_reach_disk_on_close(tmp_path: Path) -> None:
    w = TimelineWriter(tmp_path / "t.json", pid=0, flush_interval=3600)
    for i in range(5):
        w.event("x", "allreduce", float(i), 1.0)
    assert len(json.loads((tmp_path / "t.json").read_text())) == 1
    w.close()
    assert len(json.loads((tmp_path / "t.json").read_text())) == 6


def test_size_is_bounded_and_says_so(tmp_path: Path) -> None:
    w = TimelineWriter(tmp_path / "t.json", pid=0, max_bytes=4096, flush_interval=0.0)
    for i in range(1000):
        w.event("allreduce.noname.%d" % i, "allreduce", float(i), 1.0, bytes=123)
    w.close()
    assert (tmp_path / "t.json").stat().st_size < 4096 + 512
    events = json.loads((tmp_path / "t.json").read_text())
    assert events[-1]["name"] == "timeline truncated"


def test_merge_puts_ranks_on_rows(tmp_path: Path) -> None:
    paths = []
    for r in range(3):
        w = TimelineWriter(tmp_path / f"t.rank{r}.json", pid=r)
        w.event("allreduce.0", "allreduce", 10.0 + r, 2.0)
        w.close()
        paths.append(tmp_path / f"t.rank{r}.json")
    events = json.loads(merge_timelines(paths, tmp_path / "t.json").read_text())
    xs = [e for e in events if e["ph"] == "X"]
    assert [e["pid"] for e in xs] == [0, 1, 2] and len(events) == 6


def test_fp16_compression_round_trip() -> None:
    t = torch.tensor([1.0, 2.5, -3.25], dtype=torch.float64)
    wire, ctx = Compression.fp16.compress(t)
    assert wire.dtype == torch.float16
    back = Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float64 and torch.equal(back, t)
    ints = torch.arange(3)
    assert Compression.fp16.compress(ints)[0] is ints
    assert Compression.none.compress(t)[0] is t


class _LateTiming:
    """Stands in for an NCCL timing (``timing.NcclSeconds``: CUDA needs a GPU, absent
    here): not ready until the test says so, then reads ``value``."""

    def __init__(self, value: float) -> None:
        self.value, self.done, self.reads = value, False, 0

    def ready(self) -> bool:
        return self.done

    def item(self) -> float:
        self.reads += 1
        return self.value


def test_gpu_timings_are_written_once_the_device_is_done(tmp_path):
    from hvdnb.torch import timeline as tl

    path = tmp_path / "t.json"
    w = tl.TimelineWriter(path, pid=0, flush_interval=0.0)
    tl._ACTIVE["writer"] = w
    try:
        own, gap = _LateTiming(0.002), _LateTiming(0.0005)
        tl._listener("allreduce.g", 4096, own, "nccl", gap)
        w.flush()
        assert [e["name"] for e in json.loads(path.read_text())] == ["process_name"]
        assert own.reads == 0  # never read before the GPU is done: no wait in the step
        own.done = gap.done = True
        w.flush()
        ev = json.loads(path.read_text())[-1]
        assert ev["name"] == "allreduce.g" and ev["dur"] == 2000.0
        assert ev["args"]["exposed_us"] == 500.0 and ev["args"]["backend"] == "nccl"
        late = _LateTiming(0.001)  # still running at stop: read (waiting) at close
        tl._listener("allreduce.h", 8, late, "nccl", 0.0)
        w.close()
        assert json.loads(path.read_text())[-1]["dur"] == 1000.0
    finally:
        tl._ACTIVE.pop("writer", None)
