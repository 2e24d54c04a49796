"""What a newcomer waits for: ``make lab`` on a fresh clone, to a JupyterLab that serves.

For one git revision (default ``HEAD``), the bench clones the repository into a temporary
folder and runs the README's first command there, ``make lab``, twice:

- ``cold``: pip's cache is a new, empty folder (``PIP_CACHE_DIR``), as on a new laptop;
- ``warm``: the clone's ``.venv`` is removed and ``make lab`` runs again with the cache the
  cold run filled.

Each run is timed from ``make lab`` to the first answer of JupyterLab's ``/api/status``
(JupyterLab prints its address with the token; the bench reads it from the output), then the
server is stopped. The table gives both times and the size of ``.venv`` (``du``, apparent
size of its files). Package indexes or wheel folders that pip is configured to read (a local
mirror) are used as they are: the cache is the only thing emptied.

Usage: ``python bench/bench_make_lab.py [--rev REV] [--label before]``; writes
``bench/results/make_lab-<label>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ADDRESS = re.compile(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)")


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def start_lab(
    clone: Path, env: dict[str, str], timeout: float = 1800
) -> tuple[Any, str, str, float]:
    """Run ``make lab`` in ``clone`` until its JupyterLab answers: (the process, its
    address, its token, the seconds it took). The caller stops it (``stop_lab``)."""
    log = clone / "make-lab.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            ["make", "lab"],
            cwd=clone,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"make lab exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.perf_counter() - t0 > timeout:
            stop_lab(proc)
            raise RuntimeError(f"make lab: no JupyterLab after {timeout} s")
        m = ADDRESS.search(log.read_text(errors="replace"))
        if m:
            try:
                urllib.request.urlopen(f"{m[1]}/api/status?token={m[2]}", timeout=2)
                return proc, m[1], m[2], time.perf_counter() - t0
            except OSError:
                pass
        time.sleep(0.2)


@contextlib.contextmanager
def fresh_lab(tmp: str, rev: str = "HEAD") -> Iterator[tuple[Path, str, str, float]]:
    """A fresh clone of ``rev`` in ``tmp`` with ``make lab`` serving, as a newcomer gets it
    (its own Jupyter folders and run store): (the clone, the address, the token, the
    seconds ``make lab`` took). Stopped on exit."""
    clone = Path(tmp) / "hvdnb"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", rev], cwd=clone, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        BROWSER="true",
        JUPYTER_RUNTIME_DIR=str(Path(tmp) / "runtime"),
        JUPYTER_CONFIG_DIR=str(Path(tmp) / "jupyter-config"),
        JUPYTERLAB_WORKSPACES_DIR=str(Path(tmp) / "workspaces"),
        HVDNB_HOME=str(Path(tmp) / "hvdnb-home"),
    )
    proc, url, token, start_s = start_lab(clone, env)
    print(f"make lab: JupyterLab serving after {start_s:.1f} s", flush=True)
    try:
        yield clone, url, token, start_s
    finally:
        stop_lab(proc)


def stop_lab(proc: Any) -> None:
    """Stop ``make lab`` and the JupyterLab it started (their process group)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def make_lab(clone: Path, env: dict[str, str]) -> float:
    """Seconds from ``make lab`` to JupyterLab answering; the server is stopped after."""
    proc, _, _, secs = start_lab(clone, env)
    stop_lab(proc)
    return secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="the revision to clone (default HEAD)")
    ap.add_argument("--label", default=None, help="name in the results file (default: rev)")
    args = ap.parse_args()
    label = args.label or args.rev
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvdnb-make-lab-") as tmp:
        clone = Path(tmp) / "hvdnb"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", args.rev], cwd=clone, check=True)
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=clone, text=True, capture_output=True
        ).stdout.strip()
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(
            PIP_CACHE_DIR=str(Path(tmp) / "pip-cache"),
            JUPYTER_RUNTIME_DIR=str(Path(tmp) / "runtime"),
            # the kernelspec goes into .venv; the user's own Jupyter folders stay untouched
            JUPYTER_CONFIG_DIR=str(Path(tmp) / "jupyter-config"),
            BROWSER="true",
        )
        for cache in ("cold", "warm"):
            if cache == "warm":
                shutil.rmtree(clone / ".venv")
            secs = make_lab(clone, env)
            size = _du(clone / ".venv")
            rows.append({"cache": cache, "seconds": round(secs, 1), "venv_bytes": size})
            print(
                f"{label} ({rev}) {cache:5s}: JupyterLab serving after {secs:6.1f} s, "
                f".venv {size / 2**20:,.0f} MiB",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"make_lab-{label}.json"
    out.write_text(json.dumps({"label": label, "rev": rev, "rows": rows}, indent=1) + "\n")
    print("\n| revision | pip cache | to serving JupyterLab | .venv |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {label} ({rev}) | {r['cache']} | {r['seconds']} s | "
            f"{r['venv_bytes'] / 2**20:,.0f} MiB |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
