"""Logging configured from RUST_LOG / LOG_LEVEL (`info`, `openalice_scheduler=debug,
uvicorn=warn`), as text or as JSON (LOG_FORMAT), with formatters that keep each record on
its own line and blank known secrets from everything they write.

In JSON, a record also carries the ids it is about: `lease_id`, `owner_id` and
`correlation_id` of the lease it names (an argument made by `lease_ref`), and the
`request_id` and `trace_id` of the request (or span) it was written in."""

from __future__ import annotations

import logging
import math
import re
import sys
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Protocol

from opentelemetry import trace
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REDACTED = "[redacted]"
# Shorter values are not blanked: every "abc" in the log would go with them.
MIN_REDACTED_LENGTH = 4
# Every value put in a line (an argument of its message, a JSON field) is cut to this
# many characters, followed by how many more there were: a caller's string (a path of
# 60,000 characters, say, and the lease id in it) cannot make a line of any size.
MAX_VALUE_CHARS = 256
# JSON fields that are the line itself, not a value in it: the message (made of cut
# arguments) and a traceback (lines by nature, kept whole).
_WHOLE_FIELDS = frozenset({"message", "exc_info", "stack_info"})
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: each can end a
# line for a terminal or a log shipper.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]

# The request being answered, set by the access middleware (api/access.py).
request_id: ContextVar[str | None] = ContextVar("request_id", default=None)


class _Lease(Protocol):
    @property
    def lease_id(self) -> str: ...
    @property
    def owner_id(self) -> str | None: ...
    @property
    def correlation_id(self) -> str | None: ...


class LeaseRef(str):
    """A lease's id, as a log call's argument, that also carries the lease's ids as
    fields (`lease_id`, and `owner_id` and `correlation_id` when set): in text it reads
    as the id it is, in JSON those become fields of the record (ContextFields), so one
    lease's lines can be selected by id. `log.info("lease %s released", lease_ref(r))`."""

    fields: dict[str, str]


def lease_ref(lease: str | _Lease) -> LeaseRef:
    """`lease` (a lease record, a worker spec, or a bare id) as a log argument."""
    if isinstance(lease, str):
        ref = LeaseRef(lease)
        ref.fields = {"lease_id": lease}
        return ref
    ref = LeaseRef(lease.lease_id)
    ref.fields = {"lease_id": lease.lease_id}
    if lease.owner_id is not None:
        ref.fields["owner_id"] = lease.owner_id
    if lease.correlation_id is not None:
        ref.fields["correlation_id"] = lease.correlation_id
    return ref


class SafeFormatter(logging.Formatter):
    """One record, one line, and no secret in it.

    Defence in depth: the code never logs secrets nor lets a caller's string reach a log
    line unchecked, and this makes sure of it. Control characters in the line (a newline
    in a message or its args) are escaped, so no record can forge another; a traceback or
    stack, lines by nature, follows indented. Secrets are blanked in the whole output,
    traceback included: an exception's message may carry one. Each string argument is
    cut to MAX_VALUE_CHARS (`bounded`), so no value makes the line long."""

    def __init__(self, fmt: str = FORMAT, secrets: Iterable[str] = ()) -> None:
        super().__init__(fmt)
        kept = {s for s in secrets if len(s) >= MIN_REDACTED_LENGTH}
        kept |= {_escaped(s) for s in kept}  # as it appears once escaped
        # Longest first: a secret inside another must not leave the rest of that one.
        self.secrets = sorted(kept, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        _bound_args(record, self.secrets)
        return _redacted(super().format(record), self.secrets)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return _escaped(super().formatMessage(record))

    def formatException(self, ei: _ExcInfo) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


class SafeJsonFormatter(JsonFormatter):
    """One record, one JSON object on one line: `time` (RFC 3339, UTC), `level`,
    `logger`, `message`, then the record's fields (`lease_id`, `request_id`, ...) and
    `exc_info` (the traceback) when there is one.

    The same guarantees as SafeFormatter's: JSON's own escaping keeps each record on its
    line (every control character, and with `ensure_ascii` U+2028/U+2029 too, is
    escaped), and secrets are blanked in every value before it is encoded, so a
    secret can neither survive as its escaped form nor be cut from the record's
    structure. Every value, the message's arguments and each field, is cut to
    MAX_VALUE_CHARS (`bounded`), after its secrets are blanked."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__(
            ["levelname", "name", "message"],
            rename_fields={"levelname": "level", "name": "logger"},
            # uvicorn's `color_message` repeats the message with terminal colours.
            reserved_attrs=[*RESERVED_ATTRS, "color_message"],
            json_ensure_ascii=True,
        )
        kept = {s for s in secrets if len(s) >= MIN_REDACTED_LENGTH}
        self.secrets = sorted(kept, key=len, reverse=True)

    def format(self, record: logging.LogRecord) -> str:
        _bound_args(record, self.secrets)
        return super().format(record)

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["time"] = (
            datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="microseconds")
            .replace("+00:00", "Z")
        )
        super().add_fields(log_data, record, message_dict)

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        return {
            key: self._clean(value, cut=key not in _WHOLE_FIELDS) for key, value in log_data.items()
        }

    def _clean(self, value: Any, *, cut: bool) -> Any:
        """`value` with every secret blanked, then cut (`cut`: see `bounded`); what JSON
        cannot hold as it is becomes its str() first, so nothing reaches the encoder
        unchecked."""
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)  # NaN is no JSON: jq would refuse the line
        if value is None or isinstance(value, bool | int | float):
            return value
        if isinstance(value, dict):
            return {
                _redacted(str(k), self.secrets): self._clean(v, cut=cut) for k, v in value.items()
            }
        if isinstance(value, list | tuple | set | frozenset):
            return [self._clean(item, cut=cut) for item in value]
        text = _redacted(value if isinstance(value, str) else str(value), self.secrets)
        return bounded(text) if cut else text


class ContextFields(logging.Filter):
    """Adds to each record the ids it is about, where known: those of the lease among
    its arguments (LeaseRef), the `request_id` of the request it was written in, and the
    `trace_id` / `span_id` of the current span (the request's, a loop's, or the caller's
    trace when tracing is off)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            for arg in record.args:
                if isinstance(arg, LeaseRef):
                    record.__dict__.update(arg.fields)
        current = request_id.get()
        if current is not None and "request_id" not in record.__dict__:
            record.request_id = current
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = trace.format_trace_id(context.trace_id)
            record.span_id = trace.format_span_id(context.span_id)
        return True


def configure_logging(
    log_filter: str, secrets: Iterable[str] = (), log_format: str = "text"
) -> None:
    default = logging.INFO
    per_logger: dict[str, int] = {}
    for part in log_filter.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" in part:
            target, level_name = part.split("=", 1)
            per_logger[target.strip().replace("::", ".")] = _LEVELS[level_name.strip().lower()]
        else:
            default = _LEVELS[part.lower()]
    # FORMAT names no thread, process or source line: not looking them up halves what
    # a record costs (~33 µs → ~17 µs here; the service logs two per lease at `info`).
    # The logging HOWTO's "Optimization" section names these switches.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(SafeJsonFormatter(secrets))
        handler.addFilter(ContextFields())
        # A warning printed as it is would be a line that is not JSON.
        logging.captureWarnings(True)
    else:
        handler.setFormatter(SafeFormatter(FORMAT, secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(default)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # Chatty libraries stay at warning unless asked for by name.
    for name in ("urllib3", "docker", "sqlalchemy", "alembic", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(default, logging.WARNING))
    for target, level in per_logger.items():
        logging.getLogger(target).setLevel(level)


def bounded(value: str) -> str:
    """`value`, or its first MAX_VALUE_CHARS characters followed by how many more there
    were: `aaaa…(+59744 chars)`."""
    extra = len(value) - MAX_VALUE_CHARS
    return (
        value if extra <= 0 else f"{value[:MAX_VALUE_CHARS]}\N{HORIZONTAL ELLIPSIS}(+{extra} chars)"
    )


def _bound_args(record: logging.LogRecord, secrets: Iterable[str]) -> None:
    """Cut the record's long string arguments before its message is made of them. Their
    secrets are blanked first: a cut through a secret would leave a part of it that the
    blanking of the whole line no longer finds."""
    args = record.args
    if isinstance(args, tuple):
        if any(isinstance(arg, str) and len(arg) > MAX_VALUE_CHARS for arg in args):
            record.args = tuple(_bounded_arg(arg, secrets) for arg in args)
    elif isinstance(args, Mapping):  # log.info("%(path)s", {"path": ...})
        record.args = {key: _bounded_arg(arg, secrets) for key, arg in args.items()}


def _bounded_arg(arg: object, secrets: Iterable[str]) -> object:
    if isinstance(arg, str) and len(arg) > MAX_VALUE_CHARS:
        return bounded(_redacted(arg, secrets))
    return arg


def _redacted(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _escaped(text: str) -> str:
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
    )


def _indented(text: str) -> str:
    return "\n".join("    " + _escaped(line) for line in text.split("\n"))
