"""Optional dependencies name their install command: the table (``hvdnb.extras``) against
``pyproject.toml``, hvdnb's own imports, a ``%%distributed`` cell's error and an ordinary
cell of a real IPython shell. No processes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib

from hvdnb import extras
from hvdnb.notebook.cellout.cells import CellResult, DistributedCellError
from hvdnb.notebook.ipython import importhint

ROOT = Path(__file__).resolve().parents[2]
FAKE = "hvdnb_surely_missing_optional"
TF_COMMAND = f"pip install {extras.pip_target('tf')}"


@pytest.fixture
def fake_entry(monkeypatch):
    """A module in the table that is surely not installed."""
    monkeypatch.setitem(
        extras.OPTIONAL, FAKE, extras.OptionalModule("tf", None, what="a test's fake")
    )
    return FAKE


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_the_table_matches_pyprojects_extras():
    extra_reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    listed = {name: _requirement_names(reqs) for name, reqs in extra_reqs.items()}

    def installs(extra: str) -> set[str]:  # its packages, through the extras it names
        nested = [
            e for r in extra_reqs[extra] if r.startswith("hvdnb[") for e in r[6:-1].split(",")
        ]
        return listed[extra].union(*(installs(e) for e in nested))

    for module, opt in extras.OPTIONAL.items():
        assert opt.extra in listed, f"{module}: no extra {opt.extra!r} in pyproject.toml"
        if opt.package is not None:
            assert opt.package in installs(opt.extra), (module, opt)
    # every package an extra installs for hvdnb or its notebooks is in the table (the
    # linters and the documentation generator are tools, never imported by hvdnb)
    # (an extra that names hvdnb's other extras, as lessons does, is checked through them)
    packages = {opt.package for opt in extras.OPTIONAL.values()} | {"hvdnb"}
    for name, reqs in listed.items():
        if name not in ("lint", "docs"):
            assert reqs <= packages, f"extra {name!r}: {sorted(reqs - packages)} not in the table"
    assert extra_reqs["lessons"] == ["hvdnb[lessons-torch,tf]"]


@pytest.mark.parametrize(
    "module, command",
    [
        ("tensorflow", "tf"),
        ("tensorflow.keras.layers", "tf"),
        ("keras", "tf"),
        ("tf_keras", "tf"),
        ("pynvml", "gpu"),
        ("sklearn.datasets", "lessons"),
        ("playwright.sync_api", "test"),
        ("torch", None),
        ("tensorflowx", None),
    ],
)
def test_install_command_by_top_level_module(module, command):
    want = None if command is None else f"pip install {extras.pip_target(command)}"
    assert extras.install_command(module) == want


def test_the_command_names_the_clone_where_hvdnb_runs_from_one(monkeypatch):
    # this checkout is a clone: pip would look for 'hvdnb[tf]' on PyPI, so the clone is named
    assert extras.source_tree() == ROOT
    assert extras.install_command("tensorflow") == f"pip install -e '{ROOT}[tf]'"
    # an installed wheel (no Makefile beside the package): the distribution's name
    monkeypatch.setattr(extras, "source_tree", lambda: None)
    assert extras.install_command("tensorflow") == "pip install 'hvdnb[tf]'"
    tip = extras.hint("sklearn")
    assert tip is not None and "pip install 'hvdnb[lessons]'" in tip and "make lab" not in tip


def test_hint_for_an_error_shown_as_text():
    tip = extras.hint_for_error("ModuleNotFoundError", "No module named 'sklearn.datasets'")
    assert tip is not None and "sklearn" in tip and "make lab" in tip and "[test]" not in tip
    assert "install your own TensorFlow" in extras.hint_for_error(
        "ModuleNotFoundError", "No module named 'tensorflow'"
    )
    assert extras.hint_for_error("ModuleNotFoundError", "No module named 'numpyy'") is None
    assert extras.hint_for_error("ValueError", "No module named 'tensorflow'") is None
    assert extras.hint_for_error("ModuleNotFoundError", "") is None


def test_require_names_the_command_or_returns_the_module(fake_entry):
    with pytest.raises(
        ModuleNotFoundError,
        match=rf"feature X needs .*: {re.escape(extras.install_command('tensorflow'))}",
    ) as e:
        extras.require(fake_entry, "feature X")
    assert e.value.name == fake_entry and isinstance(e.value.__cause__, ModuleNotFoundError)
    assert extras.require("json", "y") is sys.modules["json"]
    with pytest.raises(ModuleNotFoundError, match="No module named 'not_in_the_table_zz'"):
        extras.require("not_in_the_table_zz", "z")  # unknown to hvdnb: Python's own error


def test_keras_callback_without_keras_names_the_extra(monkeypatch):
    from hvdnb.rank import keras as hk

    monkeypatch.setitem(sys.modules, "keras", None)  # import keras raises, as when missing
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # else its Callback is the base
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"keras_callback needs keras.*\[tf\]"):
        hk._keras_callback_base()


def _error(rank: int, ename: str, evalue: str) -> dict:
    tb = f"Traceback (most recent call last):\n  File cell, line 1\n{ename}: {evalue}\n"
    return {"ename": ename, "evalue": evalue, "traceback": tb}


def test_a_distributed_cells_missing_optional_module_gets_one_hint_line():
    res = CellResult(cell=3, ranks=[0, 1, 2])
    for r in (0, 1):
        res.errors[r] = _error(r, "ModuleNotFoundError", "No module named 'tensorflow'")
    res.errors[2] = _error(2, "ValueError", "bad")
    err = DistributedCellError(res)
    lines = err._render_traceback_()
    tips = [i for i, line in enumerate(lines) if TF_COMMAND in line]
    assert len(tips) == 1, lines  # once for the group of ranks 0,1, none for the ValueError
    assert lines[tips[0] - 1] == "ModuleNotFoundError: No module named 'tensorflow'"
    assert TF_COMMAND in str(err)
    res2 = CellResult(cell=4, ranks=[0])
    res2.errors[0] = _error(0, "ModuleNotFoundError", "No module named 'numpyy'")
    assert not any("pip install" in x for x in DistributedCellError(res2)._render_traceback_())


@pytest.fixture
def ipshell():
    """A real IPython shell with hvdnb's handler, restored after."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    before = ip.custom_exceptions
    ip.set_custom_exc((), None)
    importhint.uninstall(ip)
    assert importhint.install(ip)
    yield ip
    importhint.uninstall(ip)
    if before == (ModuleNotFoundError,):  # the session's shell had ours (load_ext hvdnb)
        importhint.install(ip)


def test_an_ordinary_cell_shows_the_usual_traceback_and_the_hint(ipshell, fake_entry, capsys):
    res = ipshell.run_cell(f"x = 1\nimport {fake_entry}.sub")
    out = capsys.readouterr()
    text = out.out + out.err
    assert not res.success and isinstance(res.error_in_exec, ModuleNotFoundError)
    assert f"No module named '{fake_entry}'" in text and "Traceback" in text
    assert text.count(TF_COMMAND) == 1
    assert sys.last_value is res.error_in_exec  # %debug finds it, as for any error
    res = ipshell.run_cell("import not_in_the_table_zz")
    text = "".join(capsys.readouterr())
    assert "No module named 'not_in_the_table_zz'" in text and "pip install" not in text
    assert ipshell.run_cell("y = 2").success


def test_another_handler_is_left_alone(ipshell):
    importhint.uninstall(ipshell)
    assert ipshell.custom_exceptions == ()

    def theirs(self, etype, value, tb, tb_offset=None):
        return None

    ipshell.set_custom_exc((KeyError,), theirs)
    try:
        assert importhint.install(ipshell) is False
        assert ipshell.custom_exceptions == (KeyError,)
    finally:
        ipshell.set_custom_exc((), None)
