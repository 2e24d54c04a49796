"""Tab keeps working after a rank was killed: parso's on-disk cache, made crash-safe.

IPython's completer uses jedi, which keeps parsed modules in parso's cache under
``~/.cache/jedi`` (one pickle per module, shared by every Python process of the user).
parso writes each pickle in place and reads it back catching only ``FileNotFoundError``. A
process killed while writing one (a rank SIGKILLed, the OOM killer: a rank loads its
completer in the background right after it starts, ``hvdnb.rank.introspect.prewarm``)
leaves a truncated file newer than its source, and from then on every completion that
reaches that module raises ``EOFError`` inside jedi: Tab answers nothing, in every kernel
of that user, until someone deletes the cache (jedi#1891). Seen in the suite: after the
fault tests, Tab in fresh kernels offered no names at all.

``harden()`` replaces parso's two file functions: a pickle is written to a temporary file
and renamed over the old one (a reader sees the whole old file or the whole new one), and
one that cannot be read is taken as a miss and removed (it is parsed again and rewritten).

Owns: those two functions. Never: change what parso caches, or where.
"""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
from typing import Any

__all__ = ["harden"]

_DONE: list[bool] = []


def harden() -> bool:
    """Make parso's cache files crash-safe in this process (once); False without parso."""
    if _DONE:
        return True
    try:
        from parso import cache as parso_cache  # noqa: PLC0415  jedi's parser: only where IPython completes
    except ImportError:
        return False
    cache: Any = parso_cache  # untyped module

    def load(hashed_grammar: Any, path: Any, p_time: float, cache_path: Any = None) -> Any:
        file = cache._get_hashed_path(hashed_grammar, path, cache_path=cache_path)
        try:
            if p_time > os.path.getmtime(file):
                return None  # outdated
            with open(file, "rb") as f:
                gc.disable()  # as parso does: unpickling a tree is much faster without
                try:
                    item = pickle.load(f)
                finally:
                    gc.enable()
        except FileNotFoundError:
            return None
        except Exception:  # truncated or foreign: a miss, and gone so it is rewritten whole
            try:
                os.unlink(file)
            except OSError:
                pass
            return None
        cache._set_cache_item(hashed_grammar, path, item)
        return item.node

    def save(hashed_grammar: Any, path: Any, item: Any, cache_path: Any = None) -> None:
        file = cache._get_hashed_path(hashed_grammar, path, cache_path=cache_path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(item, f, pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, file)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    cache._load_from_file_system = load
    cache._save_to_file_system = save
    _DONE.append(True)
    return True
