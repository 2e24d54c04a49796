"""What ``hvdnb.run_cell`` takes, checked before anything is sent: a cluster, source text, a
positive timeout. Never: start, send or wait."""

from __future__ import annotations

from typing import Any

from hvdnb.protocol.errors import InputTypeError, InputValueError

__all__ = ["check_args"]


def check_args(cluster: Any, code: Any, timeout: Any) -> None:
    """Raise ``InputTypeError`` / ``InputValueError`` for an argument ``run_cell`` refuses."""
    if not callable(getattr(cluster, "check_alive", None)):
        raise InputTypeError(
            f"run_cell needs an hvdnb.Cluster (hvdnb.current(), or hvdnb.Cluster(n=2).start()),"
            f" not {type(cluster).__name__} ({cluster!r})"
        )
    if not isinstance(code, str):
        raise InputTypeError(f"run_cell: code must be a str of source, not {type(code).__name__}")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise InputValueError(
            f"run_cell: timeout must be a positive number of seconds, not {timeout!r}"
        )
