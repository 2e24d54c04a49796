"""The first hour: what ``make lab`` and Binder install runs every lesson.

- Every module a teaching notebook imports is installed by the ``lessons`` extra and by
  Binder's requirements (``binder/requirements.txt``), read from the packages' own metadata:
  the notebooks' imports (their code cells parsed, magics and ``!`` lines left out) against
  the closure of each one's requirements, extras followed.
- The environment ``make lab`` installs (``lessons_env``: its install step, ``make install``,
  in a fresh venv) has the hvdnb kernelspec and every module the notebooks import; the
  lessons themselves run there at 2 ranks in ``tests/notebooks`` (the matrix's 2-rank
  column), so the suite runs each lesson in a student's environment without running it twice.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]-*.ipynb"))
#: modules of this repository itself (hvdnb's own dependencies are checked like any other)
OWN = {"hvdnb", "kernels_ext"}


def _code(source: str) -> str:
    """A cell's Python: cell magics' first line, line magics and shell lines become ``pass``."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%"):
        lines = lines[1:]
    return "\n".join(re.sub(r"^(\s*)[%!].*$", r"\1pass", ln) for ln in lines)


def notebook_imports() -> dict[str, set[str]]:
    """Top-level module -> the notebooks that import it (stdlib and this repository left out)."""
    found: dict[str, set[str]] = {}
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            for node in ast.walk(ast.parse(_code(src))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN:
                        found.setdefault(top, set()).add(path.stem)
    return found


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[Requirement]) -> set[str]:
    """Every distribution that installing ``roots`` installs, from the installed packages'
    metadata, each one's extras followed (``hvdnb[lessons]`` -> ``hvdnb[lessons-torch,tf]``
    -> ``tensorflow``, ...). A requirement that is not installed here fails: this
    environment must hold what it checks."""
    seen: dict[str, set[str]] = {}
    todo = [(_norm(r.name), set(r.extras)) for r in roots]
    base = default_environment()
    while todo:
        name, extras = todo.pop()
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            pytest.fail(f"{name} is required but not installed in this environment")
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(
                req.marker.evaluate({**base, "extra": e}) for e in ("", *seen[name])
            ):
                continue
            todo.append((_norm(req.name), set(req.extras)))
    return set(seen)


def binder_roots() -> list[Requirement]:
    """binder/requirements.txt's requirements; ``-e .[extra]`` is this clone, hvdnb."""
    roots = []
    for raw in (BINDER / "requirements.txt").read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line or line.startswith("--"):
            continue
        local = re.fullmatch(r"(?:-e\s+)?\.(\[[\w,-]+\])?", line)
        roots.append(Requirement(f"hvdnb{local[1] or ''}" if local else line))
    return roots


def test_every_module_the_notebooks_import_is_installed_by_lessons_and_binder():
    imports = notebook_imports()
    # the lessons' own packages, as the notebooks name them: the check reads them all
    assert {"torch", "sklearn", "tensorflow", "lightning", "transformers", "accelerate"} <= set(
        imports
    ), sorted(imports)
    owners = md.packages_distributions()
    lessons = closure([Requirement("hvdnb[lessons]")])
    binder = closure(binder_roots())
    for module, where in sorted(imports.items()):
        dists = {_norm(d) for d in owners.get(module, [])}
        assert dists, f"{module} (imported by {sorted(where)}) is installed by no package here"
        assert dists & lessons, f"{module} ({sorted(where)}): not in hvdnb[lessons] ({dists})"
        assert dists & binder, f"{module} ({sorted(where)}): not in binder/requirements.txt"


def test_binder_installs_the_lessons_and_durable_extras_and_the_cpu_torch():
    roots = binder_roots()
    hvdnb = [r for r in roots if r.name == "hvdnb"]
    # the lessons extra (one list of what the lessons import) and the durable one (the
    # server keeps a cell's output when the page reloads), as `make lab` installs them
    assert hvdnb and {"lessons", "durable"} <= hvdnb[0].extras, roots
    pin = [
        ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.startswith("torch")
    ]
    assert pin and Requirement(pin[0]) in roots, "torch pinned as in constraints.txt"
    text = (BINDER / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text
    post = BINDER / "postBuild"
    assert os.access(post, os.X_OK), "postBuild must be executable"
    assert post.read_text().startswith("#!") and "hvdnb install-kernel" in post.read_text()


def test_the_clone_hint_names_make_lab_not_the_test_extra():
    from hvdnb import extras

    tip = extras.hint_for_error("ModuleNotFoundError", "No module named 'sklearn'")
    assert tip is not None and "make lab" in tip and f"-e '{ROOT}[lessons]'" in tip, tip
    assert "[test]" not in tip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_make_lab_environment_has_the_kernel_and_every_lesson_import(lessons_env: Path):
    py = lessons_env / "python"
    spec = json.loads((lessons_env.parent / "share/jupyter/kernels/hvdnb/kernel.json").read_text())
    assert Path(spec["argv"][0]) == py and "--ext=kernels_ext.autoload" in spec["argv"]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{lessons_env}{os.pathsep}{env['PATH']}"
    res = subprocess.run(
        [str(lessons_env / "jupyter"), "kernelspec", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert re.search(r"^\s*hvdnb\s", res.stdout, re.M), res.stdout
    modules = sorted(notebook_imports())
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m) is None])"
    res = subprocess.run(
        [str(py), "-c", probe, *modules], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr
    # torch stayed the pinned CPU build (no CUDA wheels pulled in by a range)
    res = subprocess.run(
        [str(py), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.stdout.split() == ["2.13.0+cpu", "None"], res.stdout + res.stderr
