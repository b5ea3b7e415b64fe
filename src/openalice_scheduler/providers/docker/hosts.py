"""DOCKER_HOSTS: the Docker engines of a fleet, parsed and checked
(docs/backends/docker.md#a-fleet-of-docker-hosts).

One entry per engine, entries separated by `;`, each `name=address` followed by options
separated by spaces:

    gpu1=tcp://10.0.0.5:2376 gpus=0,1 max=4 region=eu price=0.9 tls=/etc/oa/tls/gpu1;
    gpu2=ssh://ops@10.0.0.6 gpus=0 max=2 region=eu

`;` and spaces separate because GPU lists are comma lists, as in LOCAL_GPU_DEVICES."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

VARIABLE = "DOCKER_HOSTS"
TLS_FILES = ("ca.pem", "cert.pem", "key.pem")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_DEVICE = re.compile(r"[A-Za-z0-9-]+")
_OPTIONS = ("gpus", "max", "region", "price", "tls")


@dataclass(frozen=True, slots=True)
class HostConfig:
    """One engine of the fleet, as the operator declared it."""

    name: str
    address: str
    devices: tuple[str, ...] = ()
    max_workers: int = 0  # 0: no cap
    region: str | None = None
    # USD per worker-hour on this host, whatever the GPU class; None:
    # LOCAL_DOCKER_PRICE_PER_HOUR's price for the class.
    price: float | None = None
    # A directory with ca.pem, cert.pem and key.pem (Docker's own names), for tcp://.
    tls_dir: str | None = None


def parse_hosts(value: str) -> list[HostConfig]:
    """The hosts of DOCKER_HOSTS, in declared order. Raises ValueError naming the
    variable, the host and what is wrong."""
    hosts: list[HostConfig] = []
    for entry in value.split(";"):
        if entry.strip():
            hosts.append(_parse_entry(entry.split()))
    if not hosts:
        raise ValueError(f"{VARIABLE}: names no host; e.g. gpu1=tcp://10.0.0.5:2376 gpus=0,1")
    names = [h.name for h in hosts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{VARIABLE}: host {twice[0]!r} is declared twice")
    return hosts


def _parse_entry(tokens: list[str]) -> HostConfig:
    name, sep, address = tokens[0].partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise ValueError(
            f"{VARIABLE}: {tokens[0][:40]!r} must start name=address, the name "
            "lowercase letters, digits and '-' (e.g. gpu1=tcp://10.0.0.5:2376)"
        )
    problem = _address_problem(address)
    if problem:
        raise ValueError(f"{VARIABLE}: host {name!r}: {problem}")
    options: dict[str, str] = {}
    for token in tokens[1:]:
        key, sep, option = token.partition("=")
        if not sep or key not in _OPTIONS:
            raise ValueError(
                f"{VARIABLE}: host {name!r}: unknown option {token[:40]!r}; "
                f"options are {', '.join(k + '=' for k in _OPTIONS)}"
            )
        if key in options:
            raise ValueError(f"{VARIABLE}: host {name!r}: {key}= given twice")
        options[key] = option
    devices = tuple(d.strip() for d in options.get("gpus", "").split(",") if d.strip())
    for device in devices:
        if not _DEVICE.fullmatch(device):
            raise ValueError(
                f"{VARIABLE}: host {name!r}: gpus= {device!r} is not a GPU index or UUID"
            )
    if len(set(devices)) != len(devices):
        raise ValueError(f"{VARIABLE}: host {name!r}: a GPU is listed twice in gpus=")
    tls_dir = options.get("tls") or None
    if tls_dir is not None:
        if not address.startswith("tcp://"):
            raise ValueError(f"{VARIABLE}: host {name!r}: tls= is for tcp:// addresses")
        missing = [f for f in TLS_FILES if not (Path(tls_dir) / f).is_file()]
        if missing:
            raise ValueError(
                f"{VARIABLE}: host {name!r}: tls= {tls_dir} lacks {', '.join(missing)}"
            )
    return HostConfig(
        name=name,
        address=address,
        devices=devices,
        max_workers=int(_number(name, "max", options.get("max", "0"), int)),
        region=options.get("region") or None,
        price=(None if "price" not in options else _number(name, "price", options["price"], float)),
        tls_dir=tls_dir,
    )


def _address_problem(address: str) -> str | None:
    """What the Docker SDK would refuse in `address` (ssh:// goes through the `ssh`
    client), found before any engine is contacted."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("unix", "tcp", "ssh") or not rest:
        return (
            f"address {address[:60]!r} must be unix:///path/docker.sock, "
            "tcp://host:port or ssh://user@host"
        )
    try:
        port = urlsplit(address).port
    except ValueError:
        return f"address {address[:60]!r} has a port that is not a number"
    if scheme == "tcp" and port is None:
        return f"address {address[:60]!r} needs a port (tcp://host:2376)"
    return None


def _number(host: str, key: str, text: str, kind: type[int] | type[float]) -> int | float:
    try:
        number = kind(text)
    except ValueError:
        number = -1
    if number < 0 or number != number:  # negative, or NaN
        raise ValueError(f"{VARIABLE}: host {host!r}: {key}= must be a number ≥ 0")
    return number
