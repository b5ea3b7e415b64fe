"""Start-up that explains itself (docs/operations/startup-errors.md#start-up-errors).

- `load_settings`: the settings from the environment, or every reason they cannot be
  used at once (the settings' own rules and the providers' configuration), one line each.
- `unknown_variables`: environment variables that look like a setting but are none
  (`SCHEDULER_PROT`), warned about, never refused.
- `wait_for_store`: PostgreSQL retried while it cannot be reached, for up to
  STARTUP_TIMEOUT_SECONDS, then one line naming where it was looked for.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticUndefined
from sqlalchemy.engine import make_url

from openalice_scheduler.config import MIN_SECRET_LENGTH, Settings
from openalice_scheduler.errors import StartupError

log = logging.getLogger(__name__)

# Read by the client and the CLI's client commands (client/core.py), not by `serve`.
CLIENT_VARIABLES = frozenset({"SCHEDULER_URL"})
# Unknown variables with these prefixes are warned about even when no setting is close.
OWN_PREFIXES = ("SCHEDULER_", "RUNPOD_", "LOCAL_DOCKER_", "STATIC_", "RENDERER_", "ANIM_")
# Other software's own: OpenTelemetry's SDK reads many OTEL_* variables we do not.
FOREIGN_PREFIXES = ("OTEL_",)
# Kubernetes' service links (a Service named `scheduler-db` gives SCHEDULER_DB_SERVICE_HOST,
# SCHEDULER_DB_PORT_5432_TCP_ADDR, SCHEDULER_DB_PORT=tcp://…): the cluster's, not
# misspelt settings.
_SERVICE_LINK = re.compile(r"_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)\w*)$")
_SERVICE_ADDRESS = re.compile(r"^(tcp|udp|sctp)://")
# How close a name must be to a setting's to be taken for a misspelling of it
# (difflib's ratio: SCHEDULER_PROT/SCHEDULER_PORT 0.93, DATABASE/DATABASE_URL 0.8).
_CLOSE = 0.85


class InvalidConfiguration(StartupError):
    """The environment cannot be served: one line per reason (where a StartupError
    otherwise has one line)."""


def load_settings(environ: Mapping[str, str]) -> Settings:
    """The settings from the environment (`environ` is the process's: pydantic-settings
    reads it). Raises InvalidConfiguration naming each invalid variable and its rule,
    never a value, followed by the misspelling warnings, which may explain them."""
    from openalice_scheduler.providers import configuration_problems

    problems: list[str] = []
    checked: Settings | None
    try:
        settings = checked = Settings()  # type: ignore[call-arg]  # from the environment
    except ValidationError as exc:
        problems = _settings_problems(exc)
        checked = _stand_in(exc)
    if checked is not None:
        problems += configuration_problems(checked)
    if problems:
        lines = [f"invalid configuration: {problem}" for problem in problems]
        warnings = [f"warning: {w}" for w in unknown_variables(environ)]
        raise InvalidConfiguration("\n".join(lines + warnings))
    return settings


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per variable that is not a setting but looks like one: close to a
    setting's name, or named like the settings are (SCHEDULER_…, RUNPOD_…)."""
    known = {name.upper() for name in Settings.model_fields}
    warnings = []
    for name, value in sorted(environ.items()):
        upper = name.upper()
        if (
            upper in known
            or upper in CLIENT_VARIABLES
            or upper.startswith(FOREIGN_PREFIXES)
            or _SERVICE_LINK.search(upper)
            or (upper.endswith("_PORT") and _SERVICE_ADDRESS.match(value))
        ):
            continue
        close = difflib.get_close_matches(upper, known, n=1, cutoff=_CLOSE)
        if f"{upper}_SECONDS" in known:
            close = [f"{upper}_SECONDS"]
        if close:
            warnings.append(f"{name} is not a setting; did you mean {close[0]}?")
        elif upper.startswith(OWN_PREFIXES):
            warnings.append(f"{name} is not a setting (docs/reference/configuration.md); ignored")
    return warnings


def prepare(settings: Settings, environ: Mapping[str, str]) -> None:
    """What `serve` does once logging is set up, before the app is built: warn about
    variables that look misspelt, and wait for the database. Raises StartupError."""
    for warning in unknown_variables(environ):
        log.warning("%s", warning)
    wait_for_store(settings)


def wait_for_store(settings: Settings) -> None:
    """PostgreSQL: return once it accepts a connection, retrying an unreachable server
    for up to STARTUP_TIMEOUT_SECONDS (it may start after the scheduler, as in a compose
    file). SQLite needs no wait: its file is opened, or refused, when the store is built."""
    url = make_url(settings.database_url)
    if url.get_backend_name() in ("postgresql", "postgres"):
        from openalice_scheduler.store.postgres import wait_until_reachable

        asyncio.run(wait_until_reachable(url, settings.startup_timeout_seconds))


def _settings_problems(exc: ValidationError) -> list[str]:
    """One line per invalid variable: its name and the rule, never the value."""
    problems: dict[str, str] = {}
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "missing":
            message = "is required but not set"
        # A check across variables has no location: its message names them itself.
        name = str(error["loc"][0]).upper() if error["loc"] else ""
        problems.setdefault(name, f"{name}: {message}" if name else message)
    return list(problems.values())


def _stand_in(exc: ValidationError) -> Settings | None:
    """Settings in which the variables already reported take their defaults, so that the
    providers' configuration can still be checked with the others' real values. None
    when even that fails (a check across variables): then only the settings' own errors
    are reported."""
    replaced: dict[str, Any] = {}
    for error in exc.errors():
        if not error["loc"]:
            return None
        name = str(error["loc"][0])
        default = Settings.model_fields[name].default
        # A required variable has no default: anything valid stands in for it.
        replaced[name] = "x" * MIN_SECRET_LENGTH if default is PydanticUndefined else default
    try:
        return Settings(**replaced)
    except ValidationError:
        return None
