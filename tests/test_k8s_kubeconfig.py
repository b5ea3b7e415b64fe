"""KUBECONFIG as a list of files, merged as kubectl merges them
(https://kubernetes.io/docs/concepts/configuration/organize-cluster-access-kubeconfig/#merging-kubeconfig-files):
the scheduler as a process against the Kubernetes emulator, its cluster, user and context
spread over several files, as a user's would be."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.harness import WORKER_IMAGE, Scheduler, printed_lines
from tests.k8s_emulator import KubeEmulator
from tests.test_k8s_provider import documented_role
from tests.test_lifecycle import serve, startable

Make = Callable[..., Scheduler]
NAMESPACE = "openalice"


@pytest.fixture
def kube(kube_server: KubeEmulator) -> KubeEmulator:
    kube_server.reset()
    kube_server.set_rbac(documented_role()["rules"])
    return kube_server


def on_k8s(make_scheduler: Make, files: list[Path | str], **env: str) -> Scheduler:
    return make_scheduler(
        PROVIDERS="kubernetes",
        KUBECONFIG=os.pathsep.join(str(f) for f in files),
        K8S_RENDERER_IMAGE=WORKER_IMAGE,
        K8S_ANIM_IMAGE=WORKER_IMAGE,
        RENDERER_READY_PATH="/healthz",
        **env,
    )


def write(path: Path, content: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(content))
    path.chmod(0o600)
    return path


def served(sched: Scheduler, kube: KubeEmulator) -> None:
    """A renderer is acquired on the emulated cluster and its worker answers."""
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert lease["provider"] == "kubernetes"
    assert kube.pod(lease["provider_token"], NAMESPACE) is not None
    assert httpx.get(lease["endpoint"] + "/", timeout=10).json()["lease_id"] == lease["lease_id"]
    assert sched.release(lease["lease_id"]).status_code == 204


def refused(sched: Scheduler, kube: KubeEmulator) -> str:
    """The provider is unhealthy (the API refused the credentials), an acquire fails and
    no pod is made: the provider's detail."""
    view = sched.http.get("/v1/providers").json()[0]
    assert view["name"] == "kubernetes" and not view["healthy"], view
    # A pod an earlier scheduler released may still be in its grace period, listed.
    before = {p["metadata"]["name"] for p in kube.pods(NAMESPACE)}
    response = sched.acquire(kind="renderer", ttl_seconds=300)
    assert response.status_code in (502, 503), response.text
    made = {p["metadata"]["name"] for p in kube.pods(NAMESPACE)} - before
    assert not made, response.text
    return str(view["detail"])


def test_the_cluster_in_one_file_and_the_context_in_another_are_merged(
    make_scheduler: Make, kube: KubeEmulator, tmp_path: Path
) -> None:
    full = kube.kubeconfig()
    # The cluster's file names its CA by a path relative to itself (kubectl resolves it
    # against that file's directory, whatever the other files and the working directory).
    cluster_dir = tmp_path / "clusters"
    cluster_dir.mkdir()
    ca = base64.b64decode(full["clusters"][0]["cluster"]["certificate-authority-data"])
    (cluster_dir / "emulator-ca.crt").write_bytes(ca)
    cluster = write(
        cluster_dir / "cluster.yaml",
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "emulator",
                    "cluster": {
                        "server": full["clusters"][0]["cluster"]["server"],
                        "certificate-authority": "emulator-ca.crt",
                    },
                }
            ],
            "users": full["users"],
        },
    )
    context = write(
        tmp_path / "home" / "context.yaml",
        {
            "apiVersion": "v1",
            "kind": "Config",
            "contexts": [full["contexts"][0]],
            "current-context": "emulator",
        },
    )
    # A file in the list that does not exist is skipped, as kubectl skips it; an empty
    # name (`a::b`) too. The context's file comes first: its directory is not the CA's.
    missing = tmp_path / "no-such-kubeconfig"
    sched = on_k8s(make_scheduler, [missing, context, "", cluster])
    served(sched, kube)
    assert kube.token not in sched.log()


def test_the_first_file_to_set_a_value_wins_and_its_entry_is_taken_whole(
    make_scheduler: Make, kube: KubeEmulator, tmp_path: Path
) -> None:
    good = kube.write_kubeconfig(tmp_path / "good.yaml")  # current-context `emulator`
    # A second file with a user of the same name that has no credentials, another user
    # with a wrong token, and a current context of its own that uses it.
    stale = write(
        tmp_path / "stale.yaml",
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [],
            "users": [
                {"name": "emulator", "user": {}},
                {"name": "stale", "user": {"token": "not-the-token"}},
            ],
            "contexts": [{"name": "stale", "context": {"cluster": "emulator", "user": "stale"}}],
            "current-context": "stale",
        },
    )
    # The good file first: its current context and its user `emulator` are the ones used.
    served(on_k8s(make_scheduler, [good, stale]), kube)
    # The other way round, the stale file's current context is used: its user's token is
    # refused by the API server.
    assert "401" in refused(on_k8s(make_scheduler, [stale, good]), kube)
    # Naming the good file's context does not help: the user `emulator` is the stale
    # file's, taken whole, and the good file's token is not merged into it.
    assert "401" in refused(on_k8s(make_scheduler, [stale, good], K8S_CONTEXT="emulator"), kube)
    # The context the second file adds is there to be named.
    served(on_k8s(make_scheduler, [good, stale], K8S_CONTEXT="emulator"), kube)
    assert "401" in refused(on_k8s(make_scheduler, [good, stale], K8S_CONTEXT="stale"), kube)


def test_a_list_that_cannot_serve_stops_start_up_with_one_line_naming_the_file(
    tmp_path: Path,
) -> None:
    valid = startable(tmp_path, PROVIDERS="kubernetes")
    secret = valid["INTERNAL_SECRET"]
    users = write(tmp_path / "users.yaml", {"users": [{"name": "u", "user": {"token": "t"}}]})
    context = write(
        tmp_path / "context.yaml",
        {
            "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "here",
        },
    )
    cluster = write(
        tmp_path / "cluster.yaml",
        {
            "clusters": [
                {
                    "name": "c",
                    "cluster": {"server": "https://127.0.0.1:1", "certificate-authority": "ca.crt"},
                }
            ]
        },
    )
    garbled = tmp_path / "garbled.yaml"
    garbled.write_text("clusters: [unclosed\n")
    cases: list[tuple[list[Path], list[str]]] = [
        # None of the files exists: each is named.
        ([tmp_path / "a-missing", tmp_path / "b-missing"], ["a-missing", "b-missing"]),
        # One that exists but does not parse is named, by the parser's own message.
        ([users, garbled], ["not a readable kubeconfig", "garbled.yaml", "ParserError"]),
        # The context's cluster is in a file left out of the list.
        ([users, context], ["Cluster 'c' of context 'here' not found"]),
        # Its user, likewise.
        ([context, cluster], ["User 'u' of context 'here' not found"]),
        # All there, but the CA the cluster's file names (relative to it) is not.
        ([users, context, cluster], [str(tmp_path / "ca.crt"), "not found"]),
    ]
    for files, words in cases:
        env = {**valid, "KUBECONFIG": os.pathsep.join(str(f) for f in files)}
        result = serve(tmp_path, env)
        lines = printed_lines(result.stderr)
        assert result.returncode == 2, (files, result.stderr)
        assert len(lines) == 1 and "KUBECONFIG" in lines[0], (files, result.stderr)
        for word in words:
            assert word in lines[0], (files, lines)
        assert "Traceback" not in result.stderr and secret not in result.stderr
    assert not (tmp_path / "cfg.db").exists(), "nothing is created by a refused start"


def test_relative_paths_are_taken_from_the_file_that_holds_them(tmp_path: Path) -> None:
    """As kubectl resolves them (client-go's ResolveLocalPaths): a cluster's CA, a user's
    certificate, key and token file, and an exec command with a `/` in it; a command
    found on PATH and an absolute path stay as they are."""
    from openalice_scheduler.providers.kubernetes.kubeconfig import load_kubeconfig

    first = write(
        tmp_path / "a" / "users.yaml",
        {
            "users": [
                {"name": "certs", "user": {"client-certificate": "c.crt", "client-key": "k/c.key"}},
                {"name": "token", "user": {"tokenFile": "../token"}},
                {"name": "plugin", "user": {"exec": {"apiVersion": "v1", "command": "bin/auth"}}},
                {"name": "onpath", "user": {"exec": {"apiVersion": "v1", "command": "aws"}}},
            ]
        },
    )
    second = write(
        tmp_path / "b" / "clusters.yaml",
        {
            "clusters": [
                {"name": "rel", "cluster": {"server": "https://x", "certificate-authority": "ca"}},
                {"name": "abs", "cluster": {"server": "https://y", "certificate-authority": "/ca"}},
            ],
            "contexts": [{"name": "c", "context": {"cluster": "rel", "user": "certs"}}],
        },
    )
    config = load_kubeconfig(f"{first}{os.pathsep}{second}")
    a, b = tmp_path / "a", tmp_path / "b"
    assert config.clusters["rel"].certificate_auth == str(b / "ca")
    assert config.clusters["abs"].certificate_auth == "/ca"
    assert config.users["certs"].client_cert == str(a / "c.crt")
    assert config.users["certs"].client_key == str(a / "k" / "c.key")
    assert config.users["token"].token_file == str(tmp_path / "token")
    exec_of = {name: config.users[name].exec for name in ("plugin", "onpath")}
    assert exec_of["plugin"] is not None and exec_of["plugin"].command == str(a / "bin" / "auth")
    assert exec_of["onpath"] is not None and exec_of["onpath"].command == "aws"
    assert config.current_context is None  # neither file sets one
