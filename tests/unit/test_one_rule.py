"""One rule, one place (issue 32 item 5): each rule below is defined once and both of its
users give the same answer, in the same words."""

from __future__ import annotations

import pytest

from hvdnb import host
from hvdnb.notebook.metrics.store import MetricsStore
from hvdnb.protocol import kinds
from hvdnb.protocol.knobs import at_step_error, make_spec
from hvdnb.rank.metrics import knobs as kn


class Sent:
    """A rank's channel that keeps what it sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def send(self, kind: str, **payload) -> None:
        self.sent.append((kind, payload))


# ------------------------------------------------------------------ reachable address
@pytest.mark.parametrize(
    "addr", ["127.0.0.1", "127.0.1.1", "localhost", "::1", "0.0.0.0", "::", ""]
)
def test_loopback_and_wildcard_addresses_are_never_handed_to_another_host(addr):
    assert host.is_loopback(addr)


@pytest.mark.parametrize("addr", ["10.0.0.5", "192.168.1.2", "fe80::1", "node7"])
def test_other_addresses_are_not_loopback(addr):
    assert not host.is_loopback(addr)


def test_reachable_address_is_the_route_to_the_first_peer_with_a_real_route(monkeypatch):
    routes = {"10.0.0.9": "127.0.0.1", "10.0.0.7": "10.0.0.2"}
    asked: list[str] = []

    def route(peer: str) -> str:
        asked.append(peer)
        if peer not in routes:
            raise OSError("no route")
        return routes[peer]

    monkeypatch.setattr(host, "route_addr", route)
    monkeypatch.setattr(host.socket, "gethostbyname", lambda name: name)
    # loopback peers and None are skipped unasked; a peer without a route and one whose
    # route is loopback are passed over; the first real route wins
    peers = [None, "127.0.0.1", "localhost", "10.0.0.8", "10.0.0.9", "10.0.0.7", "10.0.0.6"]
    assert host.reachable_addr(peers) == "10.0.0.2"
    assert asked == ["10.0.0.8", "10.0.0.9", "10.0.0.7"]


def test_reachable_address_without_a_usable_peer_is_the_host_names_address(monkeypatch):
    monkeypatch.setattr(host, "route_addr", lambda peer: "127.0.0.1")
    monkeypatch.setattr(host.socket, "gethostname", lambda: "me")
    monkeypatch.setattr(host.socket, "gethostbyname", lambda name: {"me": "10.3.3.3"}[name])
    assert host.reachable_addr([]) == "10.3.3.3"
    assert host.reachable_addr(["me", None, "::1"]) == "10.3.3.3"


# ------------------------------------------------------------------ at_step
BAD_STEPS = [-1, 2.5, "7", True]


@pytest.mark.parametrize("at", [None, 0, 12])
def test_at_step_accepts_none_and_step_numbers(at):
    assert at_step_error(at) is None


@pytest.mark.parametrize("at", BAD_STEPS)
def test_a_bad_at_step_is_refused_by_the_notebook_and_by_rank_0_in_the_same_words(at):
    words = at_step_error(at)
    assert words is not None and "at_step must be a step number >= 0" in words
    st = MetricsStore()
    st.knob_spec = make_spec({"lr": 0.1})
    assert st.refusal({"lr": 0.2}, at_step=at) == words
    # rank 0 re-checks what reaches it (another client, an older notebook): a plan that
    # carries the error, not a silently chosen step
    ch = Sent()
    k = kn.Knobs({"lr": 0.1}, None, 0, ch)
    k.on_request({"id": "r1", "values": {"lr": 0.2}, "at_step": at})
    assert ch.sent == [(kinds.KNOBS_PLAN, {"id": "r1", "error": words})]


def test_rank_0_plans_a_good_at_step_as_given():
    ch = Sent()
    k = kn.Knobs({"lr": 0.1}, None, 0, ch)
    k.on_request({"id": "r2", "values": {"lr": 0.2}, "at_step": 40})
    (kind, plan) = ch.sent[-1]
    assert kind == kinds.KNOBS_PLAN and plan["apply_at"] == 40 and "error" not in plan


# ------------------------------------------------------------------ the knob status
def test_the_knob_status_is_worded_once_for_dist_knobs_and_the_panel(capsys, recording_channel):
    """A request's fate, step by step, reads the same in ``%dist knobs`` and in the panel's
    status line (both say ``describe_change``'s words)."""
    from hvdnb.notebook.metrics.knobreq import describe_change
    from hvdnb.notebook.panel import Panel

    st = MetricsStore()
    st._channel = recording_channel([0, 1, 2])
    st.on_spec({"spec": make_spec({"lr": 0.1})})
    p = Panel(st)
    p._idle.stop()
    sent, _ = st.request_knobs(lr=0.2)
    assert sent
    rid = st._channel.sent[-1][2]["id"]
    seen = []
    for msg in [
        None,  # rank 0 has not answered
        ("plan", {"id": rid, "apply_at": 30, "values": {"lr": 0.2}}),
        ("applied", {"id": rid, "rank": 0, "step": 30, "values": {"lr": 0.2}}),
        ("applied", {"id": rid, "rank": 1, "step": 30, "values": {"lr": 0.2}}),
        ("applied", {"id": rid, "rank": 2, "step": 31, "late": True, "values": {"lr": 0.2}}),
    ]:
        if msg is not None:
            getattr(st, f"on_{'plan' if msg[0] == 'plan' else 'applied'}")(msg[1])
        words, refused = describe_change(st.knob_status())
        assert not refused
        p.render(force=True)
        assert words and words in p.knob_status.value
        seen.append(words)
    assert seen == [
        "sent; rank 0 has not answered yet",
        "every rank applies it at step 30",
        "applied on ranks 0 at step 30",
        "applied on ranks 0,1 at step 30",
        "applied on ranks 0-2 at step 30, 31 (late on ranks 2)",
    ]
    # refused by the notebook, and by rank 0: red in the panel, the same words
    assert describe_change({"error": "lr=-1 is out of range"}) == (
        "refused: lr=-1 is out of range",
        True,
    )
    st.request_knobs(lr=0.3)
    rid = st._channel.sent[-1][2]["id"]
    st.on_plan({"id": rid, "error": at_step_error(-1)})
    words, refused = describe_change(st.knob_status())
    assert refused and words == f"rank 0 refused it: {at_step_error(-1)}"
    p.render(force=True)
    assert "color:#c00" in p.knob_status.value
    assert describe_change({}) == ("", False)
