"""One log format for the whole process: every line says which peer, round and step it is about.

A swarm's logs are read side by side, so each line carries the node's short peer id, round and
inner step, whichever module logged it, ours or hivemind's. The node sets that context with
`set_log_context`; a filter on our one handler stamps it onto every record. The context is
process-wide (the loop and the swarm's event loop speak for one node); `log_context` overrides it
for one thread or task. Text by default, one JSON object per line with ``log.json_format``.
`setup_logging` routes hivemind's lines through our handler too; ``HIVEMIND_LOGLEVEL`` still sets
hivemind's own level, never ours. The formats: docs/architecture.md, "Logs and metrics".
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

FIELDS = ("peer", "round", "step")
# Peer ids share their first characters ("12D3KooW", "Qm"); the tail tells them apart, as in
# `diloco-p2p status`.
SHORT_PEER_CHARS = 8
# hivemind renames WARNING to "WARN" for the whole process; we print the standard names.
_LEVEL_NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING",
                logging.ERROR: "ERROR", logging.CRITICAL: "CRITICAL"}

_UNSET: Any = object()
_lock = threading.Lock()
_process_context: dict[str, Any] = dict.fromkeys(FIELDS)
_local_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "diloco_log_context", default=None
)


def short_peer(peer: Any) -> str | None:
    """The last characters of a peer id (a `PeerID` or its base58 string); None stays None."""
    if peer is None:
        return None
    text = peer.to_base58() if hasattr(peer, "to_base58") else str(peer)
    return text[-SHORT_PEER_CHARS:]


def _normalize(peer: Any, round: Any, step: Any) -> dict[str, Any]:
    out = {}
    if peer is not _UNSET:
        out["peer"] = short_peer(peer)
    if round is not _UNSET:
        out["round"] = None if round is None else int(round)
    if step is not _UNSET:
        out["step"] = None if step is None else int(step)
    return out


def set_log_context(*, peer: Any = _UNSET, round: Any = _UNSET, step: Any = _UNSET) -> None:
    """Update the process-wide context; fields not given keep their value, None clears one."""
    update = _normalize(peer, round, step)
    with _lock:
        _process_context.update(update)


@contextlib.contextmanager
def log_context(*, peer: Any = _UNSET, round: Any = _UNSET, step: Any = _UNSET) -> Iterator[None]:
    """Override the context for the current thread or asyncio task until the block ends."""
    merged = {**(_local_context.get() or {}), **_normalize(peer, round, step)}
    token = _local_context.set(merged)
    try:
        yield
    finally:
        _local_context.reset(token)


def get_log_context() -> dict[str, Any]:
    with _lock:
        ctx = dict(_process_context)
    ctx.update(_local_context.get() or {})
    return ctx


class ContextFilter(logging.Filter):
    """Stamps peer/round/step onto each record (values given with ``extra=`` win)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = get_log_context()
        for key in FIELDS:
            if not hasattr(record, key):
                setattr(record, key, ctx[key])
        return True


def _level(record: logging.LogRecord) -> str:
    return _LEVEL_NAMES.get(record.levelno, record.levelname)


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


class TextFormatter(logging.Formatter):
    """``time LEVEL [peer=.. round=.. step=..] logger: message``; the exception, if any, follows."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = " ".join(f"{k}={_dash(getattr(record, k, None))}" for k in FIELDS)
        line = f"{self.formatTime(record)} {_level(record):<7} [{prefix}] {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line (newlines inside the message are escaped by JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC).isoformat(timespec="milliseconds"),
            "level": _level(record),
            "logger": record.name,
            **{k: getattr(record, k, None) for k in FIELDS},
            "message": record.getMessage(),
        }
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(level: str = "INFO", json_format: bool = False, stream: TextIO | None = None) -> logging.Handler:
    """Install our one handler on the root logger (replacing a previous call's) and route
    hivemind's loggers through it. Returns the handler. Call it before hivemind forks its DHT
    process so the child logs the same way."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else TextFormatter())
    handler.addFilter(ContextFilter())
    handler._diloco_handler = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_diloco_handler", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    _route_hivemind(numeric)
    return handler


def _route_hivemind(level: int) -> None:
    try:
        from hivemind.utils.logging import use_hivemind_log_handler
    except ImportError:  # hivemind is a dependency; tolerate its absence in a stripped install
        return
    use_hivemind_log_handler("nowhere")  # propagate hivemind's records to the root logger
    env = os.environ.get("HIVEMIND_LOGLEVEL")
    hv_level = env.upper() if env else (logging.DEBUG if level <= logging.DEBUG else logging.WARNING)
    logging.getLogger("hivemind").setLevel(hv_level)
