"""Every ``%dist`` option is honoured or refused: one sweep over every action.

Pure parsing, no processes: each line below must be refused with a UsageError that quotes
the action's own usage line, before the action's handler runs (so nothing that is running
can have changed).
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import hvdnb
from hvdnb.notebook.ipython.magic_options import ACTIONS as _ACTIONS
from hvdnb.notebook.ipython.magics import DistMagics

pytestmark = [pytest.mark.timeout(60)]

#: one well-typed value per option (dest -> text): a dest missing here fails the sweep
VALID = {
    "n": "-n 2",
    "at_step": "--at-step 3",
    "after": "--after 1",
    "commands": "-c up",
    "cells": "--cells all",
    "inline": "--inline",
    "backend": "--backend gloo",
    "launcher": "--launcher mpi",
    "timeout": "--timeout 5",
    "oversubscribe": "--oversubscribe",
    "hosts": "--hosts hostfile",
    "ip": "--ip 10.0.0.1",
    "partition": "--partition gpu",
    "time": "--time 1:00:00",
    "gpus_per_node": "--gpus-per-node 4",
    "account": "--account a1",
    "tf_ps": "--tf-ps 1",
    "min_np": "--min-np 1",
    "max_np": "--max-np 2",
    "delete": "--delete a1b2c3-1",
}
#: every option whose value is typed, with a value of the wrong type
ILL_TYPED = ["-n abc", "--at-step x", "--after soon", "--timeout x", "--gpus-per-node many"]


def _options() -> dict[str, str]:
    """The parser's options: dest -> longest option string."""
    parser = DistMagics.dist.parser  # type: ignore[attr-defined]
    return {
        a.dest: max(a.option_strings, key=len)
        for a in parser._actions
        if a.option_strings and a.dest != "help"
    }


@pytest.fixture
def handlers(monkeypatch):
    """Record every action handler called (none may be, for a refused line)."""
    called: list[str] = []
    for name in _ACTIONS:
        monkeypatch.setattr(DistMagics, f"_{name}", lambda self, args, _n=name: called.append(_n))
    before = hvdnb.current()
    yield called
    assert hvdnb.current() is before


def test_the_table_names_real_options_and_the_sweep_covers_them():
    opts = _options()
    assert set(VALID) == set(opts), "a new %dist option needs a VALID value here"
    for name, action in _ACTIONS.items():
        assert action.options <= set(opts), name
        assert action.usage.startswith(f"%dist {name}"), name


def test_help_prints_every_option():
    doc = DistMagics.dist.__doc__ or ""
    for opt in _options().values():
        assert opt in doc


def _refused(shell, line: str, action: str) -> str:
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("dist", line)
    text = str(err.value)
    assert f"Usage: {_ACTIONS[action].usage}" in text, text
    return text


@pytest.mark.parametrize("action", list(_ACTIONS))
def test_unknown_option_refused_with_the_actions_usage(shell, handlers, action):
    text = _refused(shell, f"{action} --frobnicate", action)
    assert "unrecognized arguments: --frobnicate" in text
    assert handlers == []


@pytest.mark.parametrize("action", list(_ACTIONS))
@pytest.mark.parametrize("option", ILL_TYPED)
def test_ill_typed_value_refused_with_the_actions_usage(shell, handlers, action, option):
    text = _refused(shell, f"{action} {option}", action)
    assert "invalid" in text and option.split()[1] in text
    assert handlers == []


@pytest.mark.parametrize("action", list(_ACTIONS))
def test_every_option_an_action_does_not_take_is_refused_by_name(shell, handlers, action):
    not_taken = sorted(set(VALID) - _ACTIONS[action].options)
    assert not_taken or action == "start"
    for dest in not_taken:
        text = _refused(shell, f"{action} {VALID[dest]}", action)
        assert f"%dist {action} takes no {_options()[dest]}" in text
    assert handlers == []


def test_options_an_action_takes_reach_it(shell, handlers):
    for name, action in _ACTIONS.items():
        line = " ".join([name, *(VALID[d] for d in sorted(action.options))])
        shell.run_line_magic("dist", line)
    assert handlers == list(_ACTIONS)


def test_values_refused_where_an_action_takes_none(shell, handlers):
    for name, action in _ACTIONS.items():
        if not action.values:
            text = _refused(shell, f"{name} extra", name)
            assert f"%dist {name} takes no values" in text
    assert handlers == []


def test_restart_says_how_to_change_where_ranks_run(shell, handlers):
    for dest in ("launcher", "hosts", "ip", "partition", "time", "gpus_per_node", "account"):
        text = _refused(shell, f"restart {VALID[dest]}", "restart")
        assert "`%dist stop` then `%dist start`" in text
    assert handlers == []


@pytest.mark.parametrize(
    "line, message",
    [
        ("--timeout abc", "invalid float value: 'abc'"),
        ("--timeout 0", "--timeout must be a positive number"),
        ("-o 1x", "-o needs a variable name"),
        ("--bogus", "unrecognized arguments: --bogus"),
        ("-t", "expected one argument"),
    ],
)
def test_distributed_refuses_bad_options_with_its_usage(shell, line, message):
    before = hvdnb.current()
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("distributed", line, "raise SystemExit('must not run')")
    assert message in str(err.value)
    assert "Usage: %%distributed [-t RANKS]" in str(err.value)
    assert hvdnb.current() is before
