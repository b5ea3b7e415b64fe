"""KUBECONFIG as kubectl reads it: a list of files (`:`-separated on Linux) merged into
one kubeconfig. lightkube 0.22 reads one file only (`KubeConfig.from_file`), so the files
are merged here into one dict and handed to `KubeConfig.from_dict`.

The rules are client-go's (`tools/clientcmd/loader.go`, `ClientConfigLoadingRules.Load`;
https://kubernetes.io/docs/concepts/configuration/organize-cluster-access-kubeconfig/#merging-kubeconfig-files):
empty names and repeated names are ignored, a file that does not exist is skipped, a
file that cannot be read or parsed is an error; the first file to name a cluster, user
or context wins and that entry is taken whole (a later file's entry of the same name is
discarded, even its fields the first one lacks); `current-context` is the first file's
that sets one. Relative paths in a file (a cluster's `certificate-authority`, a user's
`client-certificate`, `client-key`, `tokenFile`, and an `exec` command with a `/`) are
resolved against that file's directory, as kubectl does, since the merged config has no
single directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from lightkube import ConfigError, KubeConfig
from lightkube.config.kubeconfig import SingleConfig

# The named lists of a kubeconfig and the key of each entry's body.
SECTIONS = {"clusters": "cluster", "users": "user", "contexts": "context"}
# The fields of each body that hold a file path (client-go's GetClusterFileReferences and
# GetAuthInfoFileReferences).
PATH_FIELDS = {
    "clusters": ("certificate-authority",),
    "users": ("client-certificate", "client-key", "tokenFile"),
}


def load_kubeconfig(value: str) -> KubeConfig:
    """The kubeconfig that `value` (KUBECONFIG's value, or one path) names, its files
    merged as kubectl merges them. ConfigError when none of the files exists; a file that
    exists but is not a kubeconfig raises what reading it raised (OSError, a YAML error,
    ValueError)."""
    names = list(dict.fromkeys(name for name in value.split(os.pathsep) if name))
    files = [Path(name).expanduser() for name in names]
    found = [path for path in files if path.exists()]
    if not found:
        listed = ", ".join(names) or repr(value)
        raise ConfigError(f"Configuration file {listed} not found")
    merged = merge([(path, _read(path)) for path in found])
    return KubeConfig.from_dict(merged, fname=found[0])


def select(config: KubeConfig, context: str | None) -> SingleConfig:
    """`config` at `context` (its current context if None), as `KubeConfig.get`, with a
    ConfigError too for a cluster or user the context names and no file defines (where
    lightkube raises a bare KeyError): with several files, one may have been left out."""
    name = context or config.current_context
    chosen = config.contexts.get(name) if name else None
    if chosen is not None:
        if chosen.cluster not in config.clusters:
            raise ConfigError(f"Cluster '{chosen.cluster}' of context '{name}' not found")
        if chosen.user and chosen.user not in config.users:
            raise ConfigError(f"User '{chosen.user}' of context '{name}' not found")
    single = config.get(context_name=context)
    assert single is not None  # get() raises when it finds nothing
    return single


def missing_files(config: SingleConfig) -> list[str]:
    """The files the context's cluster and user name (a CA, a client certificate or key,
    a token file) that do not exist. lightkube opens them only when it makes its client,
    where a missing one would stop start-up with a bare FileNotFoundError."""
    cluster, user = config.cluster, config.user
    named = [cluster.certificate_auth]
    if user is not None:
        named += [
            None if user.client_cert_data else user.client_cert,
            None if user.client_key_data else user.client_key,
            user.token_file,
        ]
    files = [str(config.abs_file(name)) for name in named if name]
    return [name for name in files if not Path(name).is_file()]


def merge(configs: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """One kubeconfig dict from (file, content) pairs in KUBECONFIG's order: the first
    to set a value or a named entry wins."""
    merged: dict[str, Any] = {section: [] for section in SECTIONS}
    taken: dict[str, set[str]] = {section: set() for section in SECTIONS}
    for path, config in configs:
        for section, body_key in SECTIONS.items():
            for entry in config.get(section) or []:
                if not isinstance(entry, dict) or not isinstance(entry.get(body_key), dict):
                    raise ValueError(f"{path}: an entry of {section} has no {body_key}")
                name = entry.get("name")
                if not isinstance(name, str) or not name:
                    raise ValueError(f"{path}: an entry of {section} has no name")
                if name in taken[section]:
                    continue
                taken[section].add(name)
                merged[section].append(_resolved(section, entry, body_key, path.parent))
        if "current-context" not in merged and config.get("current-context"):
            merged["current-context"] = config["current-context"]
    return merged


def _read(path: Path) -> dict[str, Any]:
    with path.open() as stream:  # a YAML error then names the file
        content = yaml.safe_load(stream) or {}  # an empty file is an empty config
    if not isinstance(content, dict):
        raise ValueError(f"{path}: not a mapping")
    return content


def _resolved(section: str, entry: dict[str, Any], body_key: str, base: Path) -> dict[str, Any]:
    """The entry with the relative paths of its body made absolute against `base`."""
    body = dict(entry[body_key])
    for field in PATH_FIELDS.get(section, ()):
        if isinstance(body.get(field), str) and body[field]:
            body[field] = _joined(base, body[field])
    exec_ = body.get("exec")
    if isinstance(exec_, dict) and "/" in str(exec_.get("command", "")):
        body["exec"] = {**exec_, "command": _joined(base, exec_["command"])}
    return {**entry, body_key: body}


def _joined(base: Path, path: str) -> str:
    """`path` against `base`, cleaned as Go's filepath.Join cleans it; an absolute one is
    kept."""
    return os.path.normpath(os.path.join(base.absolute(), path))
