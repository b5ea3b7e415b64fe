"""The modal version whose protocol the emulator answers: `contract.json`'s source
(made by make_contract.py from that version's wheel)."""

from __future__ import annotations

import json
from pathlib import Path

CHECKED_CLIENT_VERSION: str = json.loads(Path(__file__).with_name("contract.json").read_text())[
    "x-source"
]["version"]
