"""Tab and Shift-Tab on the ranks' names: completion and inspection answered by rank 0.

In a ``%%distributed`` cell (or any cell in auto mode, but ``%%local`` ones) the names a
user types live on the ranks: the model, the optimizer, the data. Tab asks rank 0 for
IPython's completions of the cell (its body, the cursor moved to match), and they are
merged with the notebook's own (magics, modules). Shift-Tab and ``name?`` on a name the
notebook does not have ask rank 0 for its signature and docstring. Only text travels, never
an object. Rank 0 has ``ANSWER_WITHIN`` seconds; past that (it is busy training) the
notebook's own answer is given alone.

Owns: the completer matcher and the inspection fallback installed in the notebook's shell
(``install``). Never: block the notebook longer than ``ANSWER_WITHIN``, or raise from a
completion (a failed answer is no answer).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from IPython.core.completer import CompletionContext, SimpleCompletion, completion_matcher

from hvdnb.notebook.cellout import automode
from hvdnb.notebook.cluster import lifecycle
from hvdnb.protocol import parsocache
from hvdnb.protocol.remote import COMPLETE, COMPLETER_PREWARM, INSPECT

__all__ = ["ANSWER_WITHIN", "install", "prewarm", "rank_body"]

#: how long rank 0 has to answer (seconds)
ANSWER_WITHIN = 0.5
_INSTALLED: set[int] = set()


def rank_body(shell: Any, full_text: str, offset: int) -> tuple[str, int] | None:
    """The code the ranks would run for this cell and the cursor's offset in it, or None
    when the cell runs in the notebook."""
    first, nl, rest = full_text.partition("\n")
    if first.strip().startswith("%%distributed"):
        start = len(first) + len(nl)
        return (rest, offset - start) if offset >= start else None
    if automode.enabled(shell) and not first.strip().startswith("%%local"):
        return full_text, offset
    return None


def _ask(call: Any, *args: Any) -> Any:
    """``call(*args)`` on rank 0, or None when no cluster runs or it does not answer in
    time."""
    c = lifecycle.current()
    if c is None or not c.running:
        return None
    try:
        return c.client[0].apply_async(call, *args).get(timeout=ANSWER_WITHIN)
    except Exception:
        return None


def prewarm(cluster: Any) -> None:
    """Have rank 0 load its completer now (IPython's first completion imports jedi: 0.6 s
    here, past ``ANSWER_WITHIN``), in a thread of its own there, without waiting for it:
    the user's first Tab gets rank 0's names, and the first cell is not held behind it."""
    try:
        cluster.client[0].apply_async(COMPLETER_PREWARM)
    except Exception:
        pass


def _make_matcher(shell: Any) -> Any:
    @completion_matcher(identifier="hvdnb_rank0", api_version=2)  # type: ignore[untyped-decorator]  # IPython: unannotated
    def rank0_matcher(context: CompletionContext) -> dict[str, Any]:
        none: dict[str, Any] = {"completions": [], "suppress": False}
        lines = context.full_text.split("\n")
        offset = sum(len(ln) + 1 for ln in lines[: context.cursor_line]) + context.cursor_position
        body = rank_body(shell, context.full_text, offset)
        if body is None:
            return none
        code, cursor = body
        got = _ask(COMPLETE, code, cursor)
        if not got:
            return none
        # one result replaces one fragment: the span most completions replace
        (start, end), _ = Counter((s, e) for _, s, e, _ in got).most_common(1)[0]
        if end != cursor:
            return none
        return {
            "completions": [
                SimpleCompletion(text, type=kind or None)
                for text, s, e, kind in got
                if (s, e) == (start, end)
            ],
            "matched_fragment": code[start:cursor],
            "suppress": False,
        }

    return rank0_matcher


def install(shell: Any) -> None:
    """Add rank 0's answers to ``shell``'s completion and inspection (once)."""
    if id(shell) in _INSTALLED:
        return
    _INSTALLED.add(id(shell))
    parsocache.harden()  # a truncated cache file (a rank killed mid-write) ends Tab here too
    shell.Completer.custom_matchers.append(_make_matcher(shell))
    local_mime = shell.object_inspect_mime
    local_inspect = shell._inspect

    def object_inspect_mime(
        oname: str, detail_level: int = 0, omit_sections: Any = ()
    ) -> dict[str, Any]:
        try:
            bundle: dict[str, Any] = local_mime(oname, detail_level, omit_sections)
            return bundle
        except KeyError:
            remote = _ask(INSPECT, oname, detail_level)
            if not remote:
                raise
            return dict(remote)

    def _inspect(meth: str, oname: str, namespaces: Any = None, **kw: Any) -> Any:
        if meth in ("pinfo", "pinfo2") and not shell._object_find(oname, namespaces).found:
            remote = _ask(INSPECT, oname, 1 if meth == "pinfo2" else 0)
            if remote:
                from IPython.core import page  # noqa: PLC0415  IPython's pager: only when used

                page.page(remote)
                return None
        return local_inspect(meth, oname, namespaces, **kw)

    shell.object_inspect_mime = object_inspect_mime
    shell._inspect = _inspect
