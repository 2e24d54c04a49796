"""parso's cache made crash-safe (``hvdnb.protocol.parsocache``): a truncated pickle, as a
process killed while writing leaves, is a miss, not an ``EOFError`` that ends every Tab.

Each test runs jedi in a fresh Python with its own cache directory (the user's is never
touched), first as parso ships (the failure is real), then hardened."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jedi")

#: complete a name of a module after truncating its cache file; prints the outcome
SCRIPT = r"""
import sys, glob, os
import jedi
jedi.settings.cache_directory = sys.argv[1]
mod = os.path.join(sys.argv[1], "..", "mod_for_cache.py")
with open(mod, "w") as f:
    f.write("def alpha_beta_gamma():\n    return 1\n" * 50)
src = "import sys; sys.path.insert(0, %r)\nimport mod_for_cache\nmod_for_cache.alpha_" % os.path.dirname(mod)
if sys.argv[2] == "hardened":
    from hvdnb.protocol import parsocache
    assert parsocache.harden()
jedi.Script(src, path="x.py").complete()  # parses and caches the module
pickles = [p for p in glob.glob(os.path.join(sys.argv[1], "**", "*.pkl"), recursive=True)]
assert pickles, "nothing cached"
for p in pickles:  # what a writer killed mid-write leaves: the first bytes only
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 3])
import parso.cache
parso.cache.parser_cache.clear()  # a new process: nothing in memory
try:
    names = [c.name for c in jedi.Script(src, path="x.py").complete()]
    print("names", names[:1])
except Exception as exc:
    print("raised", type(exc).__name__)
"""


def _run(tmp_path: Path, mode: str) -> str:
    cache = tmp_path / mode / "cache"
    cache.mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_truncated_cache_file_breaks_parso_as_shipped(tmp_path):
    assert _run(tmp_path, "shipped").startswith("raised")


def test_hardened_a_truncated_cache_file_is_a_miss(tmp_path):
    assert _run(tmp_path, "hardened") == "names ['alpha_beta_gamma']"


def test_hardened_saves_whole_files_and_leaves_no_temporary(tmp_path):
    cache = tmp_path / "c"
    cache.mkdir()
    code = (
        "import sys, jedi\n"
        f"jedi.settings.cache_directory = {str(cache)!r}\n"
        "from hvdnb.protocol import parsocache\nparsocache.harden()\n"
        "import json\njedi.Script('import json\\njson.du', path='x.py').complete()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import pickle

    files = list(cache.rglob("*"))
    assert [f for f in files if f.suffix == ".pkl"], files
    assert not [f for f in files if f.name.startswith(".part-")], files
    for f in files:
        if f.suffix == ".pkl":
            pickle.loads(f.read_bytes())  # whole
