"""The reference covers the code: every ``%dist`` action, option and public name.

No processes and no Sphinx build: the generated pages come from ``docs/_ext/hvdnb_docs.py``
(the same functions ``make docs`` calls) and the API pages' directives are read from
``docs/reference/api/*.md``. A new ``%dist`` action, option, ``HVDNB_*`` variable or public
function without its documentation fails here, naming what to add.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import hvdnb_docs  # noqa: E402

API = ROOT / "docs" / "reference" / "api"
#: the public modules whose ``__all__`` the reference must cover
MODULES = ["hvdnb", "hvdnb.metrics", "hvdnb.torch", "hvdnb.tensorflow", "hvdnb.tensorflow.keras"]
NEEDS_TF = {"hvdnb.tensorflow", "hvdnb.tensorflow.keras"}
#: Horovod's collectives: each docstring states what every rank must pass and that it blocks
COLLECTIVES = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier",
    "join", "synchronize", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object",
]  # fmt: skip


def documented() -> set[str]:
    """Every full name an API page documents (autodoc directive or a ``py:`` directive)."""
    names: set[str] = set()
    for page in API.glob("*.md"):
        text = page.read_text()
        module = re.search(r"```\{module\} ([\w.]+)", text)
        names |= set(re.findall(r"^\.\. auto\w+:: ([\w.]+)", text, re.M))
        for short in re.findall(r"^```\{py:\w+\} ([\w.]+)", text, re.M):
            names.add(short if "." in short or module is None else f"{module.group(1)}.{short}")
    return names


def public(modname: str) -> list[str]:
    if modname in NEEDS_TF and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed: pip install -e '.[tf]'")
    mod = importlib.import_module(modname)
    return [
        n for n in mod.__all__ if not n.startswith("_") and not inspect.ismodule(getattr(mod, n))
    ]


def test_every_dist_action_is_documented() -> None:
    page = hvdnb_docs.dist_actions_md()
    from hvdnb.notebook.ipython.magics import DistMagics

    for name in hvdnb_docs.dist_actions():
        method = getattr(DistMagics, f"_{name}", None)
        assert method is not None, f"%dist {name} has no DistMagics._{name}"
        assert inspect.getdoc(method), (
            f"%dist {name} is undocumented: give DistMagics._{name} a docstring (the "
            "reference's text for it)"
        )
        assert f"## `%dist {name}`" in page, f"%dist {name} is missing from the reference"


def test_every_dist_option_has_help() -> None:
    from hvdnb.notebook.ipython.magics import DistMagics

    page = hvdnb_docs.dist_actions_md()
    for act in DistMagics.dist.parser._actions:
        if act.dest == "help":
            continue
        assert act.help, f"%dist option {act.option_strings or act.dest} has no help text"
        for opt in act.option_strings:
            assert f"`{opt}`" in page, f"%dist {opt} is in no action's table"
    for act in DistMagics.distributed.parser._actions:
        if act.dest != "help":
            assert act.help, f"%%distributed {act.option_strings} has no help text"
            assert act.option_strings[0] in hvdnb_docs.distributed_options_md()


def test_every_command_line_option_has_help() -> None:
    import argparse

    from hvdnb.notebook.headless import cli

    page = hvdnb_docs.cli_md()
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"## `hvdnb {name}`" in page
        for act in parser._actions:
            if act.dest != "help":
                assert act.help, f"hvdnb {name} {act.option_strings or act.dest}: no help text"


def test_every_config_field_is_documented() -> None:
    fields = hvdnb_docs.config_fields()
    page = hvdnb_docs.config_md()
    for name, doc in fields.items():
        if name == "extra":
            continue
        assert doc, (
            f"Config.{name} has no #: comment (the reference's text for HVDNB_{name.upper()})"
        )
        assert f"`HVDNB_{name.upper()}`" in page


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_is_in_the_reference(modname: str) -> None:
    names = documented()
    mod = importlib.import_module(modname)
    missing = [n for n in public(modname) if f"{modname}.{n}" not in names]
    assert not missing, (
        f"{modname}: {missing} not in docs/reference/api/*.md; add an autodoc directive for each"
    )
    for n in public(modname):
        obj = getattr(mod, n)
        if isinstance(obj, (int, float, str)):
            continue  # documented by a py:data directive with its own text
        assert inspect.getdoc(obj), f"{modname}.{n} has no docstring"


def test_the_callable_metrics_module_is_documented() -> None:
    text = (API / "metrics.md").read_text()
    assert "```{py:function} hvdnb.metrics(name=None, rank=None, run=None)" in text
    import hvdnb

    assert callable(hvdnb.metrics)


def test_collectives_state_their_spmd_contract() -> None:
    import hvdnb.torch as hvd

    vague = [
        n
        for n in COLLECTIVES
        if not re.search(r"SPMD contract|every rank", inspect.getdoc(getattr(hvd, n)) or "")
    ]
    assert not vague, f"hvdnb.torch collectives without their SPMD contract: {vague}"
