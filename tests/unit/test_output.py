"""The output collapser and rank labels, with no processes."""

from __future__ import annotations

import pytest

from hvdnb.notebook.cellout.output import OutputCollapser, format_ranks


@pytest.mark.parametrize(
    "ranks, label",
    [
        ([0], "0"),
        ([1, 0], "0,1"),
        ([0, 1, 2, 3], "0-3"),
        ([0, 2, 4, 5, 6, 7], "0,2,4-7"),
        ([3, 3], "3"),
    ],
)
def test_format_ranks(ranks, label):
    assert format_ranks(ranks) == label


def _collapser(ranks, window=0.25):
    out: list[tuple[str, str]] = []
    return OutputCollapser(ranks, lambda s, t: out.append((s, t)), window), out


def test_identical_lines_from_all_ranks_appear_once_as_soon_as_complete():
    c, out = _collapser([0, 1, 2])
    c.feed(0, "stdout", "epoch 1\n", now=0.0)
    c.feed(1, "stdout", "epoch 1\n", now=0.01)
    assert out == []  # rank 2 has not printed it yet and the window is open
    c.feed(2, "stdout", "epoch 1\n", now=0.02)
    assert out == [("stdout", "[0-2] epoch 1\n")]


def test_line_from_some_ranks_is_emitted_after_the_window_with_those_ranks():
    c, out = _collapser([0, 1, 2], window=0.2)
    c.feed(0, "stdout", "only two\n", now=0.0)
    c.feed(2, "stdout", "only two\n", now=0.05)
    c.poll(now=0.1)
    assert out == []
    c.poll(now=0.21)
    assert out == [("stdout", "[0,2] only two\n")]


def test_different_lines_keep_their_ranks_and_each_ranks_order():
    c, out = _collapser([0, 1], window=0.1)
    c.feed(0, "stdout", "a0\nb0\n", now=0.0)
    c.feed(1, "stdout", "a1\n", now=0.0)
    c.poll(now=1.0)
    texts = [t for _, t in out]
    assert texts.index("[0] a0\n") < texts.index("[0] b0\n")
    assert "[1] a1\n" in texts


def test_repeated_line_merges_by_occurrence_not_with_itself():
    c, out = _collapser([0, 1], window=10)
    c.feed(0, "stdout", "tick\ntick\n", now=0.0)
    assert out == []  # two ticks from rank 0 must not merge into one "[0] tick"
    c.feed(1, "stdout", "tick\n", now=0.1)
    assert out == [("stdout", "[0,1] tick\n")]
    c.feed(1, "stdout", "tick\n", now=0.2)
    assert out == [("stdout", "[0,1] tick\n")] * 2


def test_partial_lines_wait_for_their_newline_and_flush_at_the_end():
    c, out = _collapser([0, 1])
    c.feed(0, "stdout", "hel", now=0.0)
    c.feed(0, "stdout", "lo\nwor", now=0.0)
    c.feed(1, "stdout", "hello\n", now=0.0)
    assert out == [("stdout", "[0,1] hello\n")]
    c.flush()
    assert out[-1] == ("stdout", "[0] wor\n")


def test_streams_are_kept_apart():
    c, out = _collapser([0, 1], window=0.1)
    c.feed(0, "stdout", "x\n", now=0.0)
    c.feed(1, "stderr", "x\n", now=0.0)
    c.flush()
    assert sorted(out) == [("stderr", "[1] x\n"), ("stdout", "[0] x\n")]


def test_a_complete_line_never_overtakes_an_older_waiting_one():
    c, out = _collapser([0, 1], window=0.5)
    c.feed(0, "stdout", "first\n", now=0.0)  # only rank 0 prints this
    c.feed(0, "stdout", "second\n", now=0.1)
    c.feed(1, "stdout", "second\n", now=0.1)  # complete, but behind "first"
    assert out == []
    c.poll(now=0.5)
    assert out == [("stdout", "[0] first\n"), ("stdout", "[0,1] second\n")]


def test_joining_a_shared_line_never_reorders_the_joining_rank():
    c, out = _collapser([0, 1])
    c.feed(0, "stdout", "before 0\nsame\n", now=0.0)
    c.feed(1, "stdout", "before 1\nsame\n", now=0.0)
    c.poll(now=1.0)
    texts = [t for _, t in out]
    assert texts.index("[1] before 1\n") < texts.index("[0,1] same\n")
    assert texts.index("[0] before 0\n") < texts.index("[0,1] same\n")
    assert len(texts) == 3


def test_a_merge_that_would_reorder_another_rank_is_refused():
    c, out = _collapser([0, 1, 2], window=10)
    c.feed(0, "stdout", "x\n", now=0.0)  # [0] x
    c.feed(2, "stdout", "w\ny\n", now=0.0)  # [2] w, [2] y
    c.feed(1, "stdout", "y\n", now=0.0)  # joins: [1,2] y
    # rank 1 printed y before x, so x must follow y; moving y ahead of x would put it
    # before rank 2's w: refused, rank 1's x stands alone
    c.feed(1, "stdout", "x\n", now=0.0)
    c.flush()
    assert [t for _, t in out] == ["[0] x\n", "[2] w\n", "[1,2] y\n", "[1] x\n"]


@pytest.mark.parametrize("seed", range(30))
def test_random_interleavings_keep_every_ranks_order(seed):
    import random

    rng = random.Random(seed)
    ranks = [0, 1, 2]
    lines = {r: [rng.choice(["a", "b", "c", f"u{r}"]) for _ in range(12)] for r in ranks}
    c, out = _collapser(ranks, window=rng.choice([0.0, 0.05, 10]))
    cursor = {r: 0 for r in ranks}
    now = 0.0
    while any(cursor[r] < 12 for r in ranks):
        r = rng.choice([q for q in ranks if cursor[q] < 12])
        c.feed(r, "stdout", lines[r][cursor[r]] + "\n", now=now)
        cursor[r] += 1
        now += rng.random() * 0.02
        c.poll(now)
    c.flush()
    for r in ranks:  # each rank's own lines, read back from the merged stream, in order
        seen = []
        for _, t in out:
            label, text = t.rstrip("\n").split("] ", 1)
            got = {
                int(x)
                for part in label[1:].split(",")
                for x in (
                    range(int(part.split("-")[0]), int(part.split("-")[1]) + 1)
                    if "-" in part
                    else [part]
                )
            }
            if r in got:
                seen.append(text)
        assert seen == lines[r]


@pytest.mark.parametrize("ranks", [[0], [0, 1], [0, 1, 2, 3], [0, 2, 4, 5, 6, 7], [3, 9]])
def test_parse_ranks_inverts_format_ranks(ranks):
    from hvdnb.notebook.cellout.output import format_ranks, parse_ranks

    assert parse_ranks(format_ranks(ranks)) == ranks


def test_per_rank_lines_counts_a_merged_line_for_each_rank():
    from hvdnb.notebook.cellout.output import per_rank_lines

    text = "[0,1] step 0\n[0] step 1\n[1] step 1\n[0-2] step 2\nnoise\n"
    assert per_rank_lines(text, r"step (\d+)") == {0: [0, 1, 2], 1: [0, 1, 2], 2: [2]}


def test_a_rank_lagging_behind_a_flood_is_shown_in_order_without_moving_held_lines():
    """The flood in a real kernel: rank 0 prints ahead, its oldest lines wait out the window
    and are shown alone, and rank 1's copies arrive later. Each late copy is shown at once;
    none is held behind rank 0's lines (which made every next line of rank 1 move it ahead:
    quadratic in the lines held)."""
    from hvdnb.notebook.cellout.output import per_rank_lines

    c, out = _collapser([0, 1], window=0.25)
    moves = []
    make_room = c._make_room
    c._make_room = lambda rank, target: moves.append(rank) or make_room(rank, target)
    n, chunk, half = 2000, 100, 50

    def lines(lo: int, hi: int) -> str:
        return "".join(f"step {i}\n" for i in range(lo, hi))

    # per chunk c (0.3 s): rank 0 prints it; rank 1 prints its first half 0.1 s later
    # (merged); rank 0 prints the next chunk; the second half waits out the window and is
    # shown alone; then rank 1's copies of that second half arrive, late
    c.feed(0, "stdout", lines(0, chunk), 0.0)
    for start in range(0, n, chunk):
        t = 0.3 * start / chunk
        c.feed(1, "stdout", lines(start, start + half), t + 0.1)
        if start + chunk < n:
            c.feed(0, "stdout", lines(start + chunk, start + 2 * chunk), t + 0.2)
        c.poll(t + 0.26)
        c.feed(1, "stdout", lines(start + half, start + chunk), t + 0.3)
    c.flush()
    got = per_rank_lines("".join(t for _, t in out), r"step (\d+)")
    assert got == {0: list(range(n)), 1: list(range(n))}
    assert any(t.startswith("[0] ") for _, t in out)  # some lines did wait out the window
    assert any(t.startswith("[0,1] ") for _, t in out)  # and some merged
    assert moves == []
