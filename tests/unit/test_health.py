"""``died_note``: the line that tells the user a rank died and how to get it back."""

from __future__ import annotations

from types import SimpleNamespace

from hvdnb.notebook.cluster import health


def _cluster(ids: list[int], n: int = 2) -> SimpleNamespace:
    # what died_note reads of a cluster: its size and the client's list of engines
    return SimpleNamespace(n=n, client=SimpleNamespace(ids=ids), membership=None)


def test_a_rank_the_client_no_longer_lists_is_named_with_the_restart():
    note = health.died_note(_cluster([0]))
    assert note is not None and note.startswith("rank(s) 1 died") and "%dist restart" in note


def test_a_rank_the_cell_found_dead_is_named_before_the_client_hears_of_it():
    # the controller's EngineError reply overtook the engine's unregistration
    assert health.died_note(_cluster([0, 1])) is None
    note = health.died_note(_cluster([0, 1]), seen=[0])
    assert note is not None and note.startswith("rank(s) 0 died") and "%dist restart" in note
    once = health.died_note(_cluster([0]), seen=[1])  # both heard of it: named once
    assert once is not None and once.startswith("rank(s) 1 died:")
