"""Optional dependencies: which extra of ``pyproject.toml`` installs each, in one table.

hvdnb imports these lazily (TensorFlow, Keras, NVML, the test tools); a notebook's cells
import them too (notebook 08: TensorFlow, scikit-learn). When one is missing, the error
names the command that installs it: hvdnb's own imports (``require``), a ``%%distributed``
cell's error (``hvdnb.notebook.cellout.cells.DistributedCellError``) and an ordinary cell of the
notebook kernel (``hvdnb.notebook.ipython.importhint``) read this table.

The command fits where hvdnb runs from. In a clone of the repository (an editable install,
as ``make lab`` makes) ``pip install 'hvdnb[tf]'`` would look for hvdnb on PyPI, so the
command names the clone: ``pip install -e '/path/to/clone[tf]'``. A module that a lesson
(``notebooks/``) imports is in the ``lessons`` extra too, and its hint says that ``make lab``
installs everything the lessons use: a student who meets it in a lesson is told the one
command that makes every lesson run, never the test extra.

Owns: ``OPTIONAL`` and the hint text. Never: import an optional module at import time, or
hide a missing module an optional *probe* may do without (NVML: a missing reading shows
"n/a"; see ``hvdnb.host`` and ``hvdnb.rank.metrics.memory``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = [
    "KERAS3_FIT_HINT",
    "OPTIONAL",
    "OptionalModule",
    "hint",
    "hint_for_error",
    "install_command",
    "pip_target",
    "require",
    "source_tree",
]


@dataclass(frozen=True)
class OptionalModule:
    """One optional module.

    Parameters
    ----------
    extra : the ``hvdnb[...]`` extra that installs it
    package : its distribution on PyPI, when the extra lists it (None: it comes with one
        the extra lists, as keras with tensorflow-cpu)
    more : distributions to install beside the extra (not in it)
    what : what it is for, for the message
    lesson : a teaching notebook imports it (the ``lessons`` extra installs it too)
    """

    extra: str
    package: str | None
    more: tuple[str, ...] = ()
    what: str = ""
    lesson: bool = False

    @property
    def command(self) -> str:
        return " ".join(["pip install", pip_target(self.extra), *self.more])


def source_tree() -> Path | None:
    """The clone hvdnb runs from (an editable install: ``pyproject.toml`` and the
    ``Makefile`` beside the package), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    if (root / "Makefile").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def pip_target(extra: str) -> str:
    """What ``pip install`` takes to add ``extra``: the clone, editable, when hvdnb runs
    from one (``-e '/path/to/clone[tf]'``), else ``'hvdnb[tf]'``."""
    root = source_tree()
    return f"-e '{root}[{extra}]'" if root is not None else f"'hvdnb[{extra}]'"


#: top-level import name -> what installs it
OPTIONAL: Final[dict[str, OptionalModule]] = {
    "tensorflow": OptionalModule("tf", "tensorflow", what="TensorFlow", lesson=True),
    "keras": OptionalModule("tf", None, what="Keras, installed with TensorFlow", lesson=True),
    "tf_keras": OptionalModule(
        "tf", "tf-keras", what="Keras 2 for TF_USE_LEGACY_KERAS=1", lesson=True
    ),
    "accelerate": OptionalModule(
        "frameworks", "accelerate", what="Hugging Face Accelerate", lesson=True
    ),
    "transformers": OptionalModule(
        "frameworks", "transformers", what="Hugging Face transformers", lesson=True
    ),
    "lightning": OptionalModule("frameworks", "lightning", what="Lightning", lesson=True),
    "pytorch_lightning": OptionalModule(
        "frameworks", "pytorch-lightning", what="Lightning", lesson=True
    ),
    "lightning_fabric": OptionalModule("frameworks", None, what="Lightning Fabric", lesson=True),
    "pynvml": OptionalModule("gpu", "nvidia-ml-py", what="NVML: GPU memory and utilisation"),
    # the lessons' data set (load_digits); nothing of hvdnb's own imports it
    "sklearn": OptionalModule("lessons", "scikit-learn", what="scikit-learn", lesson=True),
    "tensorboard": OptionalModule("test", "tensorboard", what="TensorBoard's event files"),
    "playwright": OptionalModule("test", "playwright", what="browser tests"),
    "notebook": OptionalModule("test", "notebook", what="the browser tests' Notebook 7 walk"),
    # hvdnb.server: the server runs each cell and keeps its output (a reload loses none)
    "jupyter_server_nbmodel": OptionalModule(
        "durable", "jupyter-server-nbmodel", what="server-side execution"
    ),
    "jupyter_collaboration": OptionalModule(
        "durable", "jupyter-collaboration", what="the server's copy of the notebook"
    ),
    "pytest": OptionalModule("test", "pytest", what="the test suite"),
    "pytest_timeout": OptionalModule("test", "pytest-timeout", what="the test suite"),
    "xdist": OptionalModule("test", "pytest-xdist", what="the test suite's two lanes"),
}

_NO_MODULE = re.compile(r"No module named '([^']+)'")


def _entry(module: str) -> tuple[str, OptionalModule] | None:
    top = module.split(".", 1)[0]
    opt = OPTIONAL.get(top)
    return None if opt is None else (top, opt)


def install_command(module: str) -> str | None:
    """The command that installs ``module`` (a dotted name counts by its top level), or
    None when it is not an optional dependency of hvdnb."""
    e = _entry(module)
    return None if e is None else e[1].command


def hint(module: str) -> str | None:
    """The line to add to a "No module named ..." error for ``module``, or None."""
    e = _entry(module)
    if e is None:
        return None
    top, opt = e
    gpu = "; on a GPU node install your own TensorFlow" if opt.extra == "tf" else ""
    if not opt.lesson:
        return f"hvdnb: {top} ({opt.what}) is optional; install it with: {opt.command}{gpu}"
    alone = "" if opt.extra == "lessons" else f"; {top} alone: {opt.command}"
    return (
        f"hvdnb: {top} ({opt.what}) is not installed; everything the lessons import comes "
        f"with {_lessons_command()}{alone}{gpu}"
    )


def _lessons_command() -> str:
    root = source_tree()
    if root is None:
        return f"pip install {pip_target('lessons')}"
    return f"`make lab` in {root}, or in this environment: pip install {pip_target('lessons')}"


#: Keras 3's ``fit`` under ``MultiWorkerMirroredStrategy`` (keras-team/keras#20585): the
#: per-worker batch reaches ``convert_to_tensor`` as a ``PerReplica`` value
_KERAS3_PER_REPLICA = re.compile(r"PerReplica.*unsupported type|unsupported type.*PerReplica", re.S)

#: the line added to that error: the fix, never applied silently (hvdnb does not change Keras)
KERAS3_FIT_HINT = (
    "hvdnb: Keras 3's model.fit does not run under MultiWorkerMirroredStrategy "
    f"(keras-team/keras#20585); use Keras 2: pip install {pip_target('tf')} (tf-keras), then put "
    "os.environ['TF_USE_LEGACY_KERAS'] = '1' at the top of the cell, before `import "
    "tensorflow`, and build the model with tf.keras, not `import keras` (if the ranks "
    "imported TensorFlow already: %dist restart first)"
)


def hint_for_error(ename: str, evalue: str) -> str | None:
    """The line to add to an error shown as text (a rank's ``ename`` and ``evalue``), or
    None: a ModuleNotFoundError (or ImportError) naming a module of the table gets its
    install command; Keras 3's ``PerReplica`` error in ``fit`` gets ``KERAS3_FIT_HINT``."""
    if _KERAS3_PER_REPLICA.search(evalue or ""):
        return KERAS3_FIT_HINT
    if ename not in ("ModuleNotFoundError", "ImportError"):
        return None
    m = _NO_MODULE.search(evalue or "")
    return hint(m.group(1)) if m else None


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise ``ModuleNotFoundError`` naming the
    install command (the table must list ``module``).

    Examples
    --------
    >>> keras = require("keras", "hvdnb.keras_callback")            # doctest: +SKIP
    ModuleNotFoundError: hvdnb.keras_callback needs keras ...: pip install 'hvdnb[tf]'
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        cmd = install_command(missing) or install_command(module)
        if cmd is None:
            raise
        raise ModuleNotFoundError(
            f"{feature} needs {missing}, which is not installed: {cmd}", name=missing
        ) from exc
