"""The store decides nothing (issue 36): every set of lease states its reads select by
is the core's (lifecycle/states.py), handed to it when it is opened. The import-linter
contracts in pyproject.toml (run by scripts/check) keep routes, loops and providers off
the store; this module keeps lease states out of it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from openalice_scheduler.lifecycle import states
from openalice_scheduler.models import LeaseState
from openalice_scheduler.store import schema

STORE = Path(states.__file__).parents[1] / "store"
_NAMES = {s.name for s in LeaseState}
_VALUES = {s.value for s in LeaseState}
_QUOTED = re.compile(r"'(" + "|".join(sorted(_VALUES)) + r")'")
# The one allowed: the database's own unique index, whose states are checked against the
# core's below.
ALLOWED = {schema.IDEMPOTENCY_SCOPE.text}


def test_the_store_names_no_lease_state() -> None:
    named = []
    for path in sorted(STORE.glob("*.py")):  # not migrations/: history, never changed
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "LeaseState"
                and node.attr in _NAMES
            ):
                named.append(f"{path.name}:{node.lineno}: LeaseState.{node.attr}")
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value not in ALLOWED
                and (node.value in _VALUES or _QUOTED.search(node.value))
            ):
                named.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not named, "the store names lease states; take them from StateSets:\n" + "\n".join(named)


def test_the_idempotency_index_covers_exactly_the_answered_states() -> None:
    # The database refuses a second lease for one request while the first is in one of
    # these: the same states as answer a replay of it.
    assert set(_QUOTED.findall(schema.IDEMPOTENCY_SCOPE.text)) == set(states.ANSWERED)


def test_a_lease_holds_capacity_until_it_has_ended() -> None:
    # Ended: the states no move leaves; every other state holds a worker (being made,
    # running, idle in the pool, or being destroyed).
    assert frozenset(states.ENDED) == states.FINAL
    assert set(states.HOLDS_CAPACITY) == set(LeaseState) - states.FINAL
    assert set(states.ANSWERED) < set(states.HELD) < set(states.PAID) <= set(states.HOLDS_CAPACITY)
