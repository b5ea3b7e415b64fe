"""Small pieces of pod presentation that REST and GraphQL share."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from .state import Pod

# Addresses from TEST-NET ranges (RFC 5737 / RFC 6598), so nothing that reads a runtime port
# can reach a real host by accident.
PROXY_IP = "100.65.0.2"
PUBLIC_IP = "203.0.113.7"
_PORT_RE = re.compile(r"^(\d{1,5})/(http|tcp|udp)$")


@dataclass(frozen=True)
class PortMapping:
    private: int
    public: int
    type: str
    ip: str
    is_ip_public: bool


def iso_time(moment: datetime | None) -> str | None:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ") if moment else None


def parse_port(spec: str) -> tuple[int, str] | None:
    """`"8080/http"` -> (8080, "http"); None when it is not in RunPod's `<port>/<proto>` form."""
    match = _PORT_RE.match(spec.strip())
    if not match or not 0 < int(match.group(1)) < 65536:
        return None
    return int(match.group(1)), match.group(2)


def port_mappings(pod: Pod) -> list[PortMapping]:
    """Live port map of a RUNNING pod: HTTP through RunPod's proxy, TCP on a public IP."""
    mappings = []
    for index, spec in enumerate(pod.ports):
        parsed = parse_port(spec)
        if parsed is None:
            continue
        private, proto = parsed
        if proto == "http":
            mappings.append(PortMapping(private, private, proto, PROXY_IP, False))
        else:
            mappings.append(PortMapping(private, 40000 + index, proto, PUBLIC_IP, True))
    return mappings
