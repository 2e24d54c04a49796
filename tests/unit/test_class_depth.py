"""The house rule on objects, read from the code: compose, don't stack mixins.

No hvdnb class has more than 2 hvdnb ancestors (its MRO, itself left out: a class may
extend one hvdnb base that extends one more, no longer chain and no pile of mixins). A
store made of six mixins lets every piece touch every field; an object that owns its parts
and hands each what it needs shows who may touch what (STYLE.md, "Objects").

Every module of ``hvdnb`` is imported, then every class alive that one of them defined is
found through ``object``'s subclass tree (nested classes and classes made by a call so far
included).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import hvdnb

pytestmark = [pytest.mark.timeout(120)]

MAX_ANCESTORS = 2

#: Classes still over the limit, each with why and who removes it. An entry that is no
#: longer needed fails the test too, so that it is taken out.
_ALLOWED: dict[str, str] = {}


def _is_hvdnb(cls: type) -> bool:
    mod = vars(cls).get("__module__")  # builtins such as ``type`` hold a descriptor there
    return isinstance(mod, str) and (mod == "hvdnb" or mod.startswith("hvdnb."))


def hvdnb_ancestors(cls: type) -> list[type]:
    """The hvdnb classes ``cls`` inherits from (its MRO less itself), nearest first."""
    return [c for c in cls.__mro__[1:] if _is_hvdnb(c)]


def _all_classes() -> dict[str, type]:
    for m in pkgutil.walk_packages(hvdnb.__path__, "hvdnb."):
        importlib.import_module(m.name)
    seen: dict[str, type] = {}
    stack: list[type] = [object]
    visited: set[type] = set()
    while stack:
        cls = stack.pop()
        if cls in visited:
            continue
        visited.add(cls)
        try:
            subs = type.__subclasses__(cls)
        except TypeError:  # a metaclass's own __subclasses__ signature
            subs = []
        stack.extend(subs)
        if _is_hvdnb(cls):
            seen[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return seen


CLASSES = _all_classes()


def _deep() -> dict[str, list[str]]:
    return {
        name: [c.__qualname__ for c in hvdnb_ancestors(cls)]
        for name, cls in sorted(CLASSES.items())
        if len(hvdnb_ancestors(cls)) > MAX_ANCESTORS
    }


def test_the_walk_finds_the_classes():
    """The walk sees hvdnb's classes, the composed store and its parts among them."""
    assert len(CLASSES) > 50
    for name in (
        "hvdnb.notebook.metrics.store.MetricsStore",
        "hvdnb.notebook.metrics.points.PointStore",
        "hvdnb.notebook.metrics.runs.Runs",
        "hvdnb.notebook.metrics.alarms.Alarms",
    ):
        assert name in CLASSES, name


def test_the_rule_counts_every_hvdnb_ancestor():
    """Three deep fails, two deep passes; mixins count as ancestors too."""

    def make(name: str, *bases: type) -> type:
        return type(name, bases, {"__module__": "hvdnb.fake"})

    a = make("A")
    b = make("B", a)
    c = make("C", b)
    d = make("D", c)
    m = make("M", make("N"), make("O"), b)  # three mixins side by side: 4 ancestors
    outside = type("X", (), {})  # not hvdnb: not counted
    assert [len(hvdnb_ancestors(k)) for k in (a, b, c, d, m)] == [0, 1, 2, 3, 4]
    assert hvdnb_ancestors(make("E", outside, a)) == [a]


def test_no_class_inherits_from_more_than_two_hvdnb_classes():
    deep = {k: v for k, v in _deep().items() if k not in _ALLOWED}
    assert not deep, (
        f"these classes inherit from more than {MAX_ANCESTORS} hvdnb classes: {deep}. "
        "Compose instead: give the class the parts it needs as fields (see STYLE.md, "
        "'Objects'), each handed only what it uses"
    )


def test_the_allow_list_holds_only_classes_still_over_the_limit():
    stale = sorted(k for k in _ALLOWED if k not in _deep())
    assert not stale, (
        f"{stale} no longer inherit from more than {MAX_ANCESTORS} hvdnb classes (or are "
        "gone): remove them from _ALLOWED in tests/unit/test_class_depth.py"
    )
