"""The generated parts of hvdnb's documentation, and the Sphinx extension that writes them.

Owns: the reference pages that come from the code's own definitions (every ``%dist``
action and ``%%distributed`` option from the magics' parsers and action table, the
``hvdnb`` command from its argparse parser, the configuration variables from
``hvdnb.config.Config`` and its ``#:`` comments) and the tutorials' staging (the numbered
notebooks with the outputs of a real run, a Binder link when the repository's address is
configured).

Never: copy option text by hand (a new option shows up on its own), fetch anything from the
network, or write into ``notebooks/`` (executed copies live in the executed-notebooks folder).

The ``*_md`` functions return MyST Markdown and need no Sphinx: ``tests/docs`` calls them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NOTEBOOKS = ROOT / "notebooks"
#: where the notebook tests (HVDNB_EXECUTED_DIR) and ``make docs`` keep executed copies
EXECUTED_DEFAULT = ROOT / "build" / "executed-notebooks"
GENERATED = DOCS / "reference" / "generated"
TUTORIALS = DOCS / "tutorials" / "generated"

_PREFIX = re.compile(r"^([a-z]+(?:, [a-z]+)*): ")


def _cell(text: str) -> str:
    """Text fit for one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return "`" + text.replace("`", "") + "`"


def help_for(action: str, text: str) -> str:
    """The part of a shared option's help that concerns ``action``.

    ``%dist``'s options carry one help text for every action that takes them, in
    ``"start, restart: ...; logs: ..."`` form: the segments are split at ``"; "``, a
    segment without an ``action:`` prefix continues the one before it, and a text with no
    prefix at all concerns every action.
    """
    parts: list[tuple[set[str] | None, str]] = []
    for seg in text.split("; "):
        m = _PREFIX.match(seg)
        if m:
            parts.append((set(m.group(1).split(", ")), seg[m.end() :]))
        elif parts:
            who, prev = parts[-1]
            parts[-1] = (who, f"{prev}; {seg}")
        else:
            parts.append((None, seg))
    if all(who is None for who, _ in parts):
        return text
    mine = [t for who, t in parts if who is None or action in who]
    return "; ".join(mine) if mine else text


def _option_row(act: argparse.Action, help_text: str) -> str:
    names = ", ".join(_code(o) for o in act.option_strings) or _code(act.metavar or act.dest)
    if isinstance(act, argparse._StoreTrueAction):
        kind = "flag"
    elif act.nargs in ("*", "+") or isinstance(act, argparse._AppendAction):
        kind = f"{getattr(act.type, '__name__', 'str')}, repeatable"
    else:
        kind = getattr(act.type, "__name__", "str")
    default = "" if act.default in (None, False) else _code(repr(act.default))
    return f"| {names} | {kind} | {default} | {_cell(help_text)} |"


_TABLE_HEAD = "| option | type | default | meaning |\n|---|---|---|---|"


def _doc_of(func: Any) -> str:
    """A docstring as MyST: its ``Examples::`` literal blocks become fenced code."""
    import inspect  # noqa: PLC0415

    # magic_arguments() replaces a magic's __doc__ with its help; the parser keeps the original
    parser = getattr(func, "parser", None)
    text = inspect.cleandoc((parser.description if parser else None) or func.__doc__ or "")
    out: list[str] = []
    fence = False
    for line in text.splitlines():
        if fence and line.strip() and not line.startswith("    "):
            out.append("```")
            fence = False
        if line.rstrip().endswith("::") and not fence:
            out += [line.rstrip()[:-1], "", "```python"]
            fence = True
            continue
        if fence and not line.strip() and out[-1] == "```python":
            continue
        out.append(line[4:] if fence else line)
    if fence:
        out.append("```")
    return "\n".join(out).strip() + "\n"


def dist_actions() -> dict[str, Any]:
    """``%dist``'s action table (``hvdnb.notebook.ipython.magic_options.ACTIONS``): the one list."""
    from hvdnb.notebook.ipython import magic_options  # noqa: PLC0415

    return dict(magic_options.ACTIONS)


def dist_actions_md() -> str:
    """Every ``%dist`` action: usage, what it does (its method's docstring), its options."""
    from hvdnb.notebook.ipython import magics  # noqa: PLC0415

    parser = magics.DistMagics.dist.parser
    by_dest = {a.dest: a for a in parser._actions if a.dest != "help"}
    out = []
    for name, action in dist_actions().items():
        method = getattr(magics.DistMagics, f"_{name}")
        doc = _doc_of(method)
        out.append(f"(dist-{name})=\n## `%dist {name}`\n")
        out.append(f"```text\n{action.usage}\n```\n")
        out.append(doc + "\n")
        rows = []
        if action.values:
            rows.append(_option_row(by_dest["values"], help_for(name, by_dest["values"].help)))
        for dest, act in by_dest.items():
            if dest in action.options:
                rows.append(_option_row(act, help_for(name, act.help or "")))
        if rows:
            out.append(_TABLE_HEAD + "\n" + "\n".join(rows) + "\n")
        else:
            out.append("It takes no options.\n")
    return "\n".join(out)


def distributed_options_md() -> str:
    """``%%distributed``'s usage, docstring and options, from its own parser."""
    from hvdnb.notebook.ipython import magic_options, magics  # noqa: PLC0415

    func = magics.DistMagics.distributed
    rows = [_option_row(a, a.help or "") for a in func.parser._actions if a.dest not in ("help",)]
    return (
        f"```text\n{magic_options.CELL_USAGE}\n```\n\n"
        + _doc_of(func)
        + "\n"
        + _TABLE_HEAD
        + "\n"
        + "\n".join(rows)
        + "\n"
    )


def cli_md() -> str:
    """The ``hvdnb`` command: every subcommand and argument, from its argparse parser."""
    from hvdnb.notebook.headless import cli  # noqa: PLC0415

    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = [_cell(parser.description or "") + "\n"]
    for name, p in sub.choices.items():
        p.prog = f"hvdnb {name}"
        usage = " ".join(p.format_usage().replace("usage: ", "").split())
        out.append(f"(cli-{name})=\n## `hvdnb {name}`\n")
        out.append(f"```text\n{usage}\n```\n")
        out.append(_cell(p.description or helps.get(name) or "") + "\n")
        rows = []
        for a in p._actions:
            if a.dest == "help":
                continue
            text = (a.help or "").replace("%%", "%")
            if a.choices:
                text = f"{text} (one of {', '.join(map(str, a.choices))})".strip()
            rows.append(_option_row(a, text))
        out.append(_TABLE_HEAD + "\n" + "\n".join(rows) + "\n")
        if p.epilog:
            out.append(_cell(p.epilog) + "\n")
    return "\n".join(out)


def config_fields() -> dict[str, str]:
    """Each ``Config`` field and its ``#:`` comment (read from the source, as autodoc does)."""
    from sphinx.pycode import ModuleAnalyzer  # noqa: PLC0415

    from hvdnb.config import Config  # noqa: PLC0415

    docs = ModuleAnalyzer.for_module("hvdnb.config").find_attr_docs()
    return {
        f.name: " ".join(" ".join(docs.get(("Config", f.name), [])).split())
        for f in dataclasses.fields(Config)
    }


def config_md() -> str:
    """Every ``HVDNB_*`` variable: its type, default and meaning, from ``hvdnb.config``."""
    from hvdnb.config import Config  # noqa: PLC0415

    defaults = Config()
    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        if f.name == "extra":
            continue
        doc = config_fields()[f.name]
        value = getattr(defaults, f.name)
        lines.append(
            f"| `HVDNB_{f.name.upper()}` | {f.type} | {_code(repr(value))} | {_cell(doc)} |"
        )
    return "\n".join(lines) + "\n"


# -- tutorials ------------------------------------------------------------------------------


def _sources(nb: dict[str, Any]) -> list[str]:
    return [
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


def failed_cells(nb: dict[str, Any]) -> list[str]:
    """Each code cell of an executed notebook that raised (an ``error`` output), unless it is
    tagged ``raises-exception`` (a lesson that shows an error on purpose), as
    ``cell N (first line): Ename: evalue``; N counts the notebook's cells from 1."""
    failed = []
    for i, cell in enumerate(nb["cells"], 1):
        if cell["cell_type"] != "code":
            continue
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
                first = (src.strip().splitlines() or [""])[0]
                failed.append(f"cell {i} ({first!r}): {out.get('ename')}: {out.get('evalue')}")
                break
    return failed


def executed_copy(src: Path, executed: Path) -> Path | None:
    """The executed copy of ``src`` in ``executed`` if its code is the committed code and it
    ran: it has outputs and no cell raised (``failed_cells``). A copy that ``hvdnb run -o``
    left from a failed run is never taken."""
    cand = executed / src.name
    if not cand.exists():
        return None
    try:
        ran = json.loads(cand.read_text())
    except ValueError:
        return None
    same = _sources(ran) == _sources(json.loads(src.read_text()))
    has_outputs = any(c.get("outputs") for c in ran["cells"] if c["cell_type"] == "code")
    return cand if same and has_outputs and not failed_cells(ran) else None


class TutorialNotRun(RuntimeError):
    """A lesson has no executed copy in which every cell ran: ``make docs`` stops, naming it."""


def _execute(src: Path, executed: Path, ranks: int, log: Any) -> Path:
    """Run ``src`` headless on a local CPU cluster (``hvdnb run``) into ``executed``; raise
    ``TutorialNotRun`` naming the notebook and the cell when it fails."""
    executed.mkdir(parents=True, exist_ok=True)
    out = executed / src.name
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_WAIT_POLICY="PASSIVE")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [sys.executable, "-m", "hvdnb.notebook.headless.cli", "run", str(src), "-n", str(ranks)]
    log(f"hvdnb docs: executing {src.name} on {ranks} CPU ranks (no executed copy yet)")
    res = subprocess.run(
        [*cmd, "-o", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    try:
        failed = failed_cells(json.loads(out.read_text()))
    except (OSError, ValueError):
        failed = []
    if res.returncode != 0 or failed:
        where = "; ".join(failed) or f"hvdnb run exited {res.returncode}"
        raise TutorialNotRun(
            f"notebooks/{src.name} did not run: {where}. Its page is not built from a failed "
            f"run; fix it (hvdnb run notebooks/{src.name} -n {ranks} shows the error), or tag "
            f"a cell that raises on purpose 'raises-exception'.\n{res.stderr[-2000:]}"
        )
    return out


def binder_url(repo: str, branch: str, name: str) -> str:
    """mybinder.org's address that opens notebook ``name`` of GitHub ``repo`` in JupyterLab."""
    m = re.match(r"^(?:https?://github\.com/)?([\w.-]+/[\w.-]+?)(?:\.git)?/?$", repo)
    if not m:
        raise ValueError(f"hvdnb_repository_url={repo!r}: give a GitHub address, owner/name")
    return f"https://mybinder.org/v2/gh/{m.group(1)}/{branch}?urlpath=lab/tree/notebooks/{name}"


def stage_tutorials(
    executed: Path, repo: str, branch: str, execute: bool, log: Any = print
) -> list[Path]:
    """Copy every numbered notebook's executed copy into the docs' tutorials folder.

    A notebook without an up-to-date executed copy in which every cell ran is run first when
    ``execute`` is true. One that still has none stops the build (``TutorialNotRun``, naming
    the notebook and the cell): a tutorial page never shows a traceback, nor a lesson without
    its outputs. With a repository address, each gets a link that opens it on Binder.
    """
    if TUTORIALS.exists():
        shutil.rmtree(TUTORIALS)
    TUTORIALS.mkdir(parents=True)
    staged = []
    for src in sorted(NOTEBOOKS.glob("[0-9][0-9]-*.ipynb")):
        ran = executed_copy(src, executed)
        if ran is None and execute:
            _execute(src, executed, 2, log)
            ran = executed_copy(src, executed)
        if ran is None:
            raise TutorialNotRun(
                f"notebooks/{src.name} has no executed copy in {executed} in which every cell "
                f"ran, and executing is off (hvdnb_execute_missing): run it with hvdnb run "
                f"notebooks/{src.name} -n 2 -o {executed / src.name}"
            )
        nb = json.loads(ran.read_text())
        notes = []
        if repo:
            notes.append(
                f"[Open this notebook on Binder]({binder_url(repo, branch, src.name)}) "
                "(2 CPU ranks on Binder's machine)."
            )
        notes.append(
            f"*Outputs of a real run on 2 CPU ranks (`hvdnb run notebooks/{src.name} -n 2`).*"
        )
        note = {
            "cell_type": "markdown",
            "id": "hvdnb-docs-note",
            "metadata": {},
            "source": "\n\n".join(notes),
        }
        first = nb["cells"][0]
        at = 1 if first["cell_type"] == "markdown" else 0  # after the lesson's title
        nb["cells"].insert(at, note)
        dest = TUTORIALS / src.name
        dest.write_text(json.dumps(nb, indent=1))
        staged.append(dest)
    return staged


def write_generated() -> None:
    GENERATED.mkdir(parents=True, exist_ok=True)
    pages = {
        "dist.md": dist_actions_md,
        "distributed.md": distributed_options_md,
        "cli.md": cli_md,
        "config.md": config_md,
    }
    for name, fn in pages.items():
        text = fn()
        path = GENERATED / name
        if not path.exists() or path.read_text() != text:  # unchanged: no rebuild
            path.write_text(text)


def _say(text: str) -> None:
    """Progress on stderr: shown under ``sphinx -q``, and no warning (``-W`` fails on those)."""
    print(text, file=sys.stderr, flush=True)


def _builder_inited(app: Any) -> None:
    write_generated()
    executed = Path(app.config.hvdnb_executed_dir or EXECUTED_DEFAULT)
    stage_tutorials(
        executed,
        app.config.hvdnb_repository_url,
        app.config.hvdnb_repository_branch,
        app.config.hvdnb_execute_missing,
        log=_say,
    )


def setup(app: Any) -> dict[str, Any]:
    app.add_config_value(
        "hvdnb_repository_url", os.environ.get("HVDNB_DOCS_REPOSITORY", ""), "html"
    )
    app.add_config_value("hvdnb_repository_branch", "main", "html")
    app.add_config_value("hvdnb_executed_dir", os.environ.get("HVDNB_EXECUTED_DIR", ""), "env")
    app.add_config_value("hvdnb_execute_missing", True, "env")
    app.connect("builder-inited", _builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
