"""The cell's wait without processes: ``CellWait`` fed a fake clock and scripted events.

Each test plays what the waiting loop sees (ranks finishing, failing, dying, the stop
button, ticks every 0.125 s) and checks the actions it is told to carry out, in order.
"""

from __future__ import annotations

import pytest

from hvdnb.notebook.cellout.cellwait import (
    EARLY_INTERRUPT,
    ESCALATE_AFTER,
    FAIL_FAST_AFTER,
    RESEND_AFTER,
    CellWait,
    CheckAlive,
    Escalate,
    Finish,
    Interrupt,
    LookForStall,
    Pump,
    Redraw,
)

T0 = 100.0  # the cell was sent at t=100 s (monotonic seconds)
TICK = 0.125  # the loop's output interval (a binary fraction: the fake clock is exact)


def _decisions(actions):
    """Actions other than the output every tick carries (Pump, Redraw)."""
    return [a for a in actions if not isinstance(a, (Pump, Redraw))]


def _run(wait, start, end):
    """Tick from ``start`` to ``end`` (offsets from T0); (offset, decision) pairs, in order."""
    out = []
    n = round((end - start) / TICK)
    for i in range(n + 1):
        t = start + i * TICK
        out += [(round(t, 3), a) for a in _decisions(wait.tick(T0 + t))]
    return out


def _interrupts(log):
    return [(t, a.ranks, a.why) for t, a in log if isinstance(a, Interrupt)]


def test_the_constants_are_the_documented_ones():
    assert (FAIL_FAST_AFTER, ESCALATE_AFTER, EARLY_INTERRUPT, RESEND_AFTER) == (2.0, 2.0, 0.5, 0.5)


def test_every_tick_shows_output_then_redraws_first():
    wait = CellWait([0, 1], T0, None, stall_after=0)
    acts = wait.tick(T0 + 0.125)
    assert acts[:2] == [Pump(), Redraw()]
    assert acts[2:] == [CheckAlive()]  # a healthy cell: the cluster is checked every tick


def test_all_ranks_done_finishes_once():
    wait = CellWait([0, 1, 2], T0, None, stall_after=5)
    for r in (2, 0):
        assert wait.rank_done(r, T0 + 0.2) == []
    assert Finish() not in wait.tick(T0 + 0.3)
    assert wait.rank_done(1, T0 + 0.35) == []
    assert wait.tick(T0 + 0.4) == [Pump(), Redraw(), Finish()]
    assert wait.finished and wait.note == ""
    assert wait.tick(T0 + 0.5) == []  # nothing after the end


def test_a_failed_rank_gets_its_peers_interrupted_after_the_grace_period_only():
    wait = CellWait([0, 1, 2], T0, None, stall_after=1.0)
    wait.tick(T0 + 0.1)
    assert wait.rank_done(1, T0 + 0.5, failed=True) == []  # no interrupt yet
    log = _run(wait, 0.625, 0.5 + FAIL_FAST_AFTER + 0.375)
    # exactly one interrupt, of the ranks still running, once the grace period has passed;
    # no health or stall checks once a rank failed (the wait is ending)
    ints = _interrupts(log)
    assert [(r, why) for _, r, why in ints] == [((0, 2), "fail-fast")]
    assert ints[0][0] > 0.5 + FAIL_FAST_AFTER
    assert not [a for _, a in log if isinstance(a, (CheckAlive, LookForStall))]
    wait.rank_done(0, T0 + 3.0, failed=True)
    wait.rank_done(2, T0 + 3.1, failed=True)
    assert _decisions(wait.tick(T0 + 3.2)) == [Finish()]
    assert wait.note == ""  # the errors speak for themselves


def test_a_dead_rank_gets_its_peers_interrupted_at_once():
    wait = CellWait([0, 1, 2], T0, None, stall_after=0)
    wait.tick(T0 + 1.0)
    acts = wait.rank_done(2, T0 + 1.0, dead=True)
    assert acts == [Interrupt((0, 1), "dead-peer")]
    # no second interrupt for the grace period's end, and only one for a second death
    assert wait.rank_done(1, T0 + 1.125, dead=True) == []
    log = _run(wait, 1.125, 3.5)
    assert _interrupts(log) == []
    assert [a for _, a in log if isinstance(a, Escalate)] == [Escalate((0,))]  # rank 0 stayed


def test_ctrl_c_interrupts_the_running_ranks_once():
    wait = CellWait([0, 1], T0, None, stall_after=0)
    wait.rank_done(0, T0 + 1.0)
    assert wait.ctrl_c(T0 + 1.5) == [Interrupt((1,), "ctrl-c")]
    assert wait.note == "interrupted from the notebook"
    assert wait.ctrl_c(T0 + 1.6) == []  # a second Ctrl-C sends nothing more
    wait.rank_done(1, T0 + 1.7, failed=True)
    assert _decisions(wait.tick(T0 + 1.8)) == [Finish()]


def test_ranks_that_ignore_the_interrupt_escalate():
    wait = CellWait([0, 1, 2], T0, None, stall_after=0)
    wait.rank_done(0, T0 + 1.0)
    assert wait.ctrl_c(T0 + 2.0) == [Interrupt((1, 2), "ctrl-c")]
    assert wait.ctrl_c(T0 + 3.0) == []  # pressed twice: still one interrupt
    log = _run(wait, 2.125, 2.0 + ESCALATE_AFTER + 0.5)
    esc = [(t, a) for t, a in log if isinstance(a, Escalate)]
    assert len(esc) == 1 and esc[0][1] == Escalate((1, 2))
    assert esc[0][0] > 2.0 + ESCALATE_AFTER
    assert log[-1][1] == esc[0][1]  # the last thing the wait says
    assert wait.finished
    assert wait.note == (
        "interrupted from the notebook; rank(s) 1,2 did not stop within 2 s of an interrupt"
    )


def test_the_cell_timeout_interrupts_once_and_says_so():
    wait = CellWait([0, 1], T0, timeout=5.0, stall_after=0)
    assert _interrupts(_run(wait, 0.125, 5.0)) == []  # not past it yet
    log = _run(wait, 5.125, 5.5)
    assert _interrupts(log) == [(5.125, (0, 1), "timeout")]
    assert wait.note.startswith("cell timed out after 5 s")
    # the ranks stop: the cell ends with the timeout's note
    wait.rank_done(0, T0 + 5.6, failed=True)
    wait.rank_done(1, T0 + 5.6, failed=True)
    assert _decisions(wait.tick(T0 + 5.7)) == [Finish()]
    assert "timed out" in wait.note


def test_a_timeout_then_ranks_that_stay_escalates_with_both_notes():
    wait = CellWait([0], T0, timeout=1.0, stall_after=0)
    log = _run(wait, 0.125, 1.0 + ESCALATE_AFTER + 0.5)
    assert [a for _, a in log if isinstance(a, (Interrupt, Escalate))] == [
        Interrupt((0,), "timeout"),
        Escalate((0,)),
    ]
    assert wait.note.startswith("cell timed out after 1 s") and "did not stop" in wait.note


def test_an_interrupt_right_after_the_submit_is_sent_once_more():
    # an engine that had not begun the cell yet ignores SIGINT
    wait = CellWait([0, 1], T0, None, stall_after=0)
    assert wait.ctrl_c(T0 + 0.125) == [Interrupt((0, 1), "ctrl-c")]
    log = _interrupts(_run(wait, 0.25, 1.5))
    assert [(r, why) for _, r, why in log] == [((0, 1), "resend")]
    assert log[0][0] > 0.125 + RESEND_AFTER


def test_a_late_interrupt_is_not_sent_twice():
    wait = CellWait([0, 1], T0, None, stall_after=0)
    assert wait.ctrl_c(T0 + EARLY_INTERRUPT + 1.0) == [Interrupt((0, 1), "ctrl-c")]
    assert _interrupts(_run(wait, 1.625, 3.375)) == []


def test_stall_checks_begin_only_after_stall_after():
    wait = CellWait([0, 1], T0, None, stall_after=3.0)
    log = _run(wait, 0.125, 4.0)
    looks = [t for t, a in log if isinstance(a, LookForStall)]
    alive = [t for t, a in log if isinstance(a, CheckAlive)]
    assert looks and min(looks) >= 3.0 and looks == [t for t in alive if t >= 3.0]
    assert len(alive) == 32  # every tick checks the cluster


@pytest.mark.parametrize("stall_after", [0, -1])
def test_no_stall_checks_when_the_detector_is_off(stall_after):
    wait = CellWait([0], T0, None, stall_after=stall_after)
    assert not [a for _, a in _run(wait, 0.125, 10.0) if isinstance(a, LookForStall)]


def test_no_stall_checks_once_a_rank_failed_or_was_interrupted():
    wait = CellWait([0, 1], T0, None, stall_after=1.0)
    wait.rank_done(0, T0 + 2.0, failed=True)
    assert not [a for _, a in _run(wait, 2.0, 3.5) if isinstance(a, LookForStall)]


def test_an_answered_pdb_prompt_restarts_the_stall_countdown_and_drops_the_timeout():
    wait = CellWait([0, 1], T0, timeout=4.0, stall_after=3.0)
    _run(wait, 0.125, 2.875)
    wait.prompt_answered(T0 + 3.0)  # a rank sat at breakpoint() until t=3
    log = _run(wait, 3.0, 8.0)
    looks = [t for t, a in log if isinstance(a, LookForStall)]
    assert looks and min(looks) >= 6.0  # 3 s after the prompt, not after the submit
    assert _interrupts(log) == []  # the 4 s timeout no longer applies
