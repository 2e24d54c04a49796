"""Sphinx configuration of hvdnb's documentation (``make docs``).

Why Sphinx + MyST + myst-nb + furo: autodoc imports the package, so it sees what a static
reader of the source misses (the callable ``hvdnb.metrics`` module, the names ``hvdnb``
exports lazily through ``__getattr__``); napoleon renders the numpydoc docstrings the Jupyter
ecosystem writes; myst-nb renders the teaching notebooks with their saved outputs and
executes nothing itself; MyST keeps every page in Markdown. ``docs/_ext/hvdnb_docs.py``
generates the ``%dist``, ``%%distributed``, command-line and configuration references from
the code's own definitions. Nothing is fetched: no intersphinx, no remote theme assets.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
# autodoc reads the tree this conf.py belongs to, whatever is installed
sys.path.insert(0, str(HERE.parent))
# the suite's rule: documentation never sees (or initialises) a GPU
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# hvdnb.tensorflow.keras is written for tf-keras (Keras 2)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

project = "hvdnb"
author = "hvdnb contributors"
copyright = "hvdnb contributors"
release = version = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "hvdnb_docs",
]

# The repository's public address (one setting): a Binder link on every tutorial and the
# theme's source link. Empty: no links. E.g. HVDNB_DOCS_REPOSITORY=github.com/owner/hvdnb
hvdnb_repository_url = os.environ.get("HVDNB_DOCS_REPOSITORY", "")
hvdnb_repository_branch = os.environ.get("HVDNB_DOCS_BRANCH", "main")

# reference/generated/: included into the reference pages, not pages of their own
exclude_patterns = ["_build", "_ext", "reference/generated", "**/.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# every cross-reference must resolve, except to libraries whose inventories we do not ship
nitpicky = True
_EXTERNAL = (
    r"(torch|tf|tensorflow|keras|tf_keras|numpy|np|pandas|pd|ipywidgets|ipyparallel|IPython"
    r"|argparse|pathlib|collections|typing|types|concurrent|threading|subprocess|mpi4py|sqlite3"
    r"|datetime|os|io|contextlib|enum|dataclasses|abc|nbformat|optparse)(\..*)?"
)
# internal classes that a public function returns or a public class holds: named in the
# signature, not part of the reference
_INTERNAL = (
    r"hvdnb\.(torch|tensorflow)\.compression\.\w+Compressor|hvdnb\.rank\.metrics\.core\.Recorder"
    r"|hvdnb\.notebook\.tf\.tfcoord\.Scheduled|hvdnb\.notebook\.metrics\.watchers\.WatchSettings"
)
nitpick_ignore_regex = [
    (r"py:.*", _INTERNAL),
    (r"py:.*", _EXTERNAL),
    (r"py:.*", r"(int|float|str|bytes|bool|dict|list|tuple|set|frozenset|object|type|None)(\[.*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Sequence|Mapping|TypeVar|Path|Tensor)"),
    (r"py:.*", r"(Exception|RuntimeError|ValueError|KeyError|TypeError|BaseException)"),
    (r"py:.*", r"(optional|callable|iterable|array-like|default|of|or)"),
]

# -- autodoc / napoleon --------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
# a subclass of a torch or Keras class would show its base's docstrings, in their own style
autodoc_inherit_docstrings = False
autodoc_default_options = {"exclude-members": "__init__, __new__"}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# parameter types as written (plain text), not cross-references: many are prose
napoleon_use_param = False

# -- MyST / myst-nb ------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# the notebooks are staged with the outputs of a real run (hvdnb_docs); never run them here
nb_execution_mode = "off"
# a widget's view has no saved state in a headless run: show its text/plain (or nothing)
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_merge_streams = True
# a fence without a language is shown as text; notebook cells say ipython3
highlight_language = "text"
pygments_style = "friendly"
# option names keep their two hyphens (no en dash) and quotes stay straight
smartquotes = False

# -- HTML ----------------------------------------------------------------------------------
html_theme = "furo"
html_title = "hvdnb"
html_static_path: list[str] = []
html_theme_options: dict[str, object] = {}
if hvdnb_repository_url:
    _repo = hvdnb_repository_url.removeprefix("https://").removeprefix("http://")
    html_theme_options = {
        "source_repository": f"https://{_repo}",
        "source_branch": hvdnb_repository_branch,
        "source_directory": "docs/",
    }
