"""What ranks draw: progress bars on a rank's own screen, displays with their ids, a rank's
``clear_output``. The screen (``hvdnb.notebook.cellout.terminal``) with the byte streams real
libraries write, and the ``Streamer`` with the messages a rank sends, its display calls
recorded. No processes."""

from __future__ import annotations

import re

import pytest

from hvdnb.notebook.cellout import streaming
from hvdnb.notebook.cellout.streaming import Streamer
from hvdnb.notebook.cellout.terminal import Screen, redraws, strip_controls

CSI_MOVES = re.compile(r"\x1b\[[0-9;?]*[A-Za-ln-z]")


def test_plain_tqdm_ends_at_its_final_state():
    s = Screen()
    for i in range(0, 301, 50):
        s.feed(f"\r{i * 100 // 300:3d}%|{'#' * (i // 30):10s}| {i}/300 [00:00<?, 96.91it/s]")
    s.feed("\n")
    assert s.text() == "100%|##########| 300/300 [00:00<?, 96.91it/s]"
    assert s.at_rest


def test_keras_progbar_backspaces_then_carriage_return():
    s = Screen()
    prev = ""
    for step in (1, 64, 128):
        bar = f"{step:3d}/128 [{'=' * (step * 10 // 128):10s}] - loss: 0.{step:04d}"
        s.feed("\b" * len(prev) + "\r" + bar)
        prev = bar
    s.feed("\n")
    assert s.text() == "128/128 [==========] - loss: 0.0128"


def test_rich_live_cursor_up_and_erase_redraw_two_lines_in_place():
    s = Screen()
    s.feed("\x1b[?25lEpoch 0 \x1b[32m━━╺━━\x1b[0m 1/128\nloss 0.9\n")
    for step in (64, 128):
        # rich's position_cursor: \r, erase, (up, erase) per extra line, then the render
        s.feed("\r\x1b[2K\x1b[1A\x1b[2K\x1b[1A\x1b[2K")
        s.feed(f"Epoch 0 \x1b[32m━━━━━\x1b[0m {step}/128\nloss 0.{step}\n")
    s.feed("\x1b[?25h")
    assert s.text() == "Epoch 0 \x1b[32m━━━━━\x1b[0m 128/128\nloss 0.128"
    assert not CSI_MOVES.search(s.text())  # colour kept, no cursor codes


def test_which_text_redraws():
    assert redraws("\r 10%") and redraws("\b\b") and redraws("\x1b[2K") and redraws("\x1b[?25l")
    assert not redraws("epoch 1\r\n") and not redraws("\x1b[31mred\x1b[0m\n")
    assert strip_controls("\x1b[2K\x1b[1A\x1b[31mx\x1b[0m") == "\x1b[31mx\x1b[0m"


def test_the_screen_keeps_its_last_lines():
    s = Screen(max_lines=5)
    s.feed("".join(f"line {i}\n" for i in range(20)))
    assert s.text().splitlines() == [f"line {i}" for i in range(16, 20)]


@pytest.fixture
def published(monkeypatch, capsys):
    """Every display the streamer publishes: (data, display_id, update)."""
    calls = []
    monkeypatch.setattr(
        streaming, "_publish", lambda data, md, did, update: calls.append((data, did, update))
    )
    return calls


def _stream(s, rank, text, name="stderr"):
    s.receive(rank, "stream", {"name": name, "text": text})


def test_each_ranks_bar_is_its_own_display_updated_in_place(published, capsys):
    s = Streamer([0, 1], window=10.0)
    _stream(s, 0, "start\n", "stdout")
    _stream(s, 1, "start\n", "stdout")
    for i in range(1, 4):
        _stream(s, 0, f"\r{i}/3 rank0")
        _stream(s, 1, f"\r{i - 1}/3 rank1")  # rank 1 lags: its own line shows it
        s.pump()
    _stream(s, 0, "\n")
    _stream(s, 1, "\r3/3 rank1\n")
    _stream(s, 0, "done\n", "stdout")
    _stream(s, 1, "done\n", "stdout")
    s.pump(final=True)
    out = capsys.readouterr()
    assert out.out == "[0,1] start\n[0,1] done\n", out  # plain lines still merge
    ids = {did for _, did, _ in published}
    assert len(ids) == 2  # one display per rank's bar
    last = {}
    for data, did, update in published:
        last[did] = data["text/plain"]
    assert sorted(last.values()) == ["[0] 3/3 rank0", "[1] 3/3 rank1"]
    firsts = [upd for _, _, upd in published]
    assert firsts.count(False) == 2  # made once each, then only updated
    assert "\r" not in out.err and "\r" not in "".join(last.values())


def test_a_display_id_and_its_updates_stay_the_ranks_own(published, capsys):
    s = Streamer([0, 1], window=0.0)
    for r in (0, 1):
        s.receive(
            r,
            "display_data",
            {"data": {"text/plain": f"v0 r{r}"}, "transient": {"display_id": "plot"}},
        )
    for r in (0, 1):
        s.receive(
            r,
            "update_display_data",
            {"data": {"text/plain": f"v1 r{r}"}, "transient": {"display_id": "plot"}},
        )
    s.pump(final=True)
    assert published == [
        ({"text/plain": "v0 r0"}, "hvdnb-r0-plot", False),
        ({"text/plain": "v0 r1"}, "hvdnb-r1-plot", False),
        ({"text/plain": "v1 r0"}, "hvdnb-r0-plot", True),
        ({"text/plain": "v1 r1"}, "hvdnb-r1-plot", True),
    ]
    assert capsys.readouterr().out == "[0] output:\n[1] output:\n"


def test_clear_output_wait_then_display_replaces_only_that_ranks_drawing(published, capsys):
    s = Streamer([0, 1], window=0.0)
    s.receive(1, "display_data", {"data": {"text/plain": "rank 1's table"}})
    for step in range(3):
        s.receive(0, "clear_output", {"wait": True})
        s.receive(0, "display_data", {"data": {"image/png": f"frame{step}"}})
    s.pump(final=True)
    made = [did for _, did, update in published if not update]
    assert len(made) == 2  # rank 1's table and rank 0's first frame; later frames update it
    frame_id = made[1]
    assert [d["image/png"] for d, did, _ in published if did == frame_id] == [
        "frame0",
        "frame1",
        "frame2",
    ]
    assert all(did != made[0] for _, did, upd in published if upd)  # rank 1 untouched
    s.receive(0, "clear_output", {"wait": False})
    s.pump(final=True)
    assert published[-1] == ({"text/plain": ""}, frame_id, True)


def test_a_c_cores_info_log_stays_out_of_the_cell_unless_asked(published, capsys, monkeypatch):
    log = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795857587.081208   21982 port.cc:153] oneDNN custom operations are on.\n"
        "E0000 00:00:1795857587.9   21982 cuda_platform.cc:52] failed call to cuInit\n"
        "a line of the user's\n"
    )
    s = Streamer([0], window=0.0)
    _stream(s, 0, log)
    s.pump(final=True)
    assert capsys.readouterr().err == (
        "[0] E0000 00:00:1795857587.9   21982 cuda_platform.cc:52] failed call to cuInit\n"
        "[0] a line of the user's\n"
    )
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the user asked for them
    s = Streamer([0], window=0.0)
    _stream(s, 0, log)
    s.pump(final=True)
    assert "I0000" in capsys.readouterr().err
