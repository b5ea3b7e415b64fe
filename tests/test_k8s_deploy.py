"""The manifests that run the scheduler itself in a cluster (deploy/kubernetes/): each is
a valid object of the Kubernetes API, its Role is the one the provider needs, its probes
hit paths the service serves, its environment names real settings with values the
service accepts, and its pod passes the `restricted` Pod Security level
(docs/operations/kubernetes-deploy.md)."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib
import inspect
import re
import tomllib
import types
import typing
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from openalice_scheduler.config import Settings
from tests.harness import Scheduler
from tests.k8s_emulator.scheduling import quantity
from tests.test_k8s_provider import documented_role

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
NAMESPACE = "openalice"
# The lightkube-models modules whose resources a manifest may be (the kinds it may have).
RESOURCE_MODULES = ("core_v1", "apps_v1", "rbac_authorization_v1")


def manifests() -> dict[str, dict[str, Any]]:
    """Every Kubernetes object of deploy/kubernetes/, by `Kind/name` (one per file; the
    kustomization is kustomize's, not the API's)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        assert len(docs) == 1, f"{path.name}: one object per file"
        found[f"{docs[0]['kind']}/{docs[0]['metadata']['name']}"] = docs[0]
    return found


def the(kind: str) -> dict[str, Any]:
    [obj] = [obj for obj in manifests().values() if obj["kind"] == kind]
    return obj


def pod_spec() -> dict[str, Any]:
    return dict(the("Deployment")["spec"]["template"]["spec"])


def container() -> dict[str, Any]:
    [only] = pod_spec()["containers"]
    return dict(only)


# --- the Kubernetes schema, offline -----------------------------------------------------


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would refuse to decode in `obj`: every unknown field, value of
    the wrong JSON type and missing required field, each with its path.

    The schema is Kubernetes v1.37's own, as lightkube-models 1.37.0.8 (locked) holds it:
    its dataclasses are generated from the OpenAPI document of that release, field by
    field (JSON name, type, required), and tests/k8s_emulator/make_contract.py already
    derives the emulator's request contract from them the same way. They are turned into
    a JSON Schema with `additionalProperties: false`, as the API server decodes with
    strict field validation (kubectl's default: an unknown field is an error, not
    dropped), and checked with jsonschema 4.26 (locked), which names every error's path.
    Why this over the alternatives: it needs no network and no new dependency, and it is
    the same release's schema the emulator checks the provider's pods against.
    `kubernetes-validate` would bring the same OpenAPI-derived schemas as a 22 MB wheel of
    25 releases; kubeconform and kubeval download theirs. What the models leave untyped
    are the values of maps (labels, annotations, resource quantities: `dict`), and what
    no schema holds is the API server's validation beyond it (name syntax, quantity
    syntax, one handler per probe, ...): the tests below check what of it matters here."""
    kinds = resource_kinds()
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in kinds:
        return [f"no kind {key[1]!r} in version {key[0]!r} (one of {sorted(kinds)})"]
    validator = jsonschema.Draft202012Validator(object_schema(kinds[key]))
    return sorted(
        f"{'.'.join(str(p) for p in error.absolute_path) or '(root)'}: {error.message}"
        for error in validator.iter_errors(obj)
    )


@cache
def resource_kinds() -> dict[tuple[str, str], type]:
    """(apiVersion, kind) -> lightkube's resource class, for every resource of the
    modules a manifest may use."""
    kinds: dict[tuple[str, str], type] = {}
    for name in RESOURCE_MODULES:
        module = importlib.import_module(f"lightkube.resources.{name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            info = getattr(cls, "_api_info", None)
            if info is None or info.action is not None or info.parent is not None:
                continue  # a subresource (status, scale, eviction)
            group, version = info.resource.group, info.resource.version
            api_version = f"{group}/{version}" if group else version
            kinds[(api_version, info.resource.kind)] = cls
    return kinds


@cache
def object_schema(cls: type) -> dict[str, Any]:
    definitions: dict[str, Any] = {}
    root = _schema_of(cls, definitions)
    info = cls._api_info  # type: ignore[attr-defined]
    group, version = info.resource.group, info.resource.version
    return {
        "$defs": definitions,
        "allOf": [root],
        "properties": {
            "apiVersion": {"const": f"{group}/{version}" if group else version},
            "kind": {"const": info.resource.kind},
        },
        "required": ["apiVersion", "kind", "metadata"],
    }


def _schema_of(tp: Any, definitions: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        if sorted(args, key=str) == sorted([int, str], key=str):
            return {"type": ["integer", "string"]}  # IntOrString
        [only] = args
        return _schema_of(only, definitions)
    if origin is list:
        return {"type": "array", "items": _schema_of(args[0], definitions)}
    scalars = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if tp in scalars:
        return {"type": scalars[tp]}
    if tp is dict or origin is dict:
        return {"type": "object"}
    if tp is datetime.datetime:
        return {"type": "string", "format": "date-time"}
    if tp is typing.Any:
        return {}
    assert dataclasses.is_dataclass(tp) and isinstance(tp, type), tp
    name = f"{tp.__module__.rsplit('.', 1)[-1]}.{tp.__name__}"
    if name not in definitions:
        definitions[name] = {}  # a placeholder while its fields are made (recursion)
        hints = typing.get_type_hints(tp)
        properties = {}
        required = []
        for field in dataclasses.fields(tp):
            json_name = field.metadata.get("json", field.name)
            properties[json_name] = _schema_of(hints[field.name], definitions)
            no_default = field.default is dataclasses.MISSING
            if no_default and field.default_factory is dataclasses.MISSING:
                required.append(json_name)
        definitions[name] = {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
    return {"$ref": f"#/$defs/{name}"}


def test_every_manifest_is_a_valid_object_of_the_kubernetes_api() -> None:
    # The schema is the locked models' (requirements.lock), of Kubernetes v1.37.
    assert metadata.version("lightkube-models").startswith("1.37.")
    found = manifests()
    kinds = sorted(obj["kind"] for obj in found.values())
    assert kinds == [
        "Deployment",
        "Namespace",
        "PersistentVolumeClaim",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "ServiceAccount",
    ]
    for name, obj in found.items():
        assert schema_errors(obj) == [], name
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE, name


MISTAKES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "a misspelt field": (
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="x"),
        "spec.template.spec.containers.0: Additional properties are not allowed "
        "('imagePullPolicyy' was unexpected)",
    ),
    "a misspelt field at the top": (
        lambda d: d["spec"].update(replica=1),
        "spec: Additional properties are not allowed ('replica' was unexpected)",
    ),
    "a number as a string": (
        lambda d: d["spec"].update(replicas="1"),
        "spec.replicas: '1' is not of type 'integer'",
    ),
    "a string as a list": (
        lambda d: d["spec"]["template"]["spec"]["containers"][0].update(args="serve"),
        "spec.template.spec.containers.0.args: 'serve' is not of type 'array'",
    ),
    "a boolean as a string": (
        lambda d: d["spec"]["template"]["spec"]["securityContext"].update(runAsNonRoot="true"),
        "spec.template.spec.securityContext.runAsNonRoot: 'true' is not of type 'boolean'",
    ),
    "a required field left out": (
        lambda d: d["spec"].pop("selector"),
        "spec: 'selector' is a required property",
    ),
    "a wrong apiVersion": (
        lambda d: d.update(apiVersion="extensions/v1beta1"),
        "no kind 'Deployment' in version 'extensions/v1beta1'",
    ),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_schema_check_refuses_a_mistake(mistake: str) -> None:
    change, expected = MISTAKES[mistake]
    deployment = copy.deepcopy(the("Deployment"))
    change(deployment)
    errors = schema_errors(deployment)
    assert [e for e in errors if e.startswith(expected)], errors


def test_labels_and_quantities_are_what_the_api_server_accepts() -> None:
    """The map values the schema leaves untyped: labels and annotations are strings (a
    YAML `true` or `1.0` is not), quantities parse as the emulator's API server parses
    them (Kubernetes' quantity syntax: `512Mi`, `250m`; not `512MB`)."""
    quantities = []
    for name, obj in manifests().items():
        for meta in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata")):
            for field in ("labels", "annotations"):
                for key, value in ((meta or {}).get(field) or {}).items():
                    assert isinstance(key, str) and isinstance(value, str), (name, key, value)
        if obj["kind"] == "PersistentVolumeClaim":
            quantities += obj["spec"]["resources"]["requests"].values()
    resources = container()["resources"]
    quantities += [*resources["requests"].values(), *resources["limits"].values()]
    quantities += [v["emptyDir"]["sizeLimit"] for v in pod_spec()["volumes"] if "emptyDir" in v]
    assert len(quantities) >= 5
    for value in quantities:
        assert isinstance(value, str)
        quantity(value)  # raises on a bad one
    with pytest.raises(ValueError, match="quantities must match"):
        quantity("512MB")
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])


# --- what the service and the provider need ---------------------------------------------


def test_the_role_is_the_documented_one_bound_to_the_scheduler_s_account() -> None:
    role, binding, account = the("Role"), the("RoleBinding"), the("ServiceAccount")
    # The provider's verbs, as the docs give them (tests/test_k8s_provider.py holds the
    # code to those), in the namespace the pods go to.
    assert role["rules"] == documented_role()["rules"]
    # K8S_NAMESPACE is the pod's own namespace: the Role's, wherever it is applied.
    assert env()["K8S_NAMESPACE"] == "field:metadata.namespace"
    assert role["metadata"]["namespace"] == the("Deployment")["metadata"]["namespace"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert pod_spec()["serviceAccountName"] == account["metadata"]["name"]
    assert pod_spec().get("automountServiceAccountToken", True), "the provider uses its token"


def env() -> dict[str, str]:
    """The container's environment: values as given, a Secret's key as `secret:name/key`,
    a field of the pod as `field:path`."""
    found = {}
    for item in container()["env"]:
        source = item.get("valueFrom", {})
        if "value" in item:
            found[item["name"]] = item["value"]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            found[item["name"]] = f"secret:{ref['name']}/{ref['key']}"
        else:
            found[item["name"]] = f"field:{source['fieldRef']['fieldPath']}"
    return found


def resolved_env() -> dict[str, str]:
    """The environment as the kubelet gives it to the container in the Deployment's
    namespace (a Secret's value aside)."""
    namespace = the("Deployment")["metadata"]["namespace"]
    fields = {"field:metadata.namespace": namespace}
    return {name: fields.get(value, value) for name, value in env().items()}


def test_the_environment_names_real_settings_with_values_the_service_accepts() -> None:
    known = {name.upper() for name in Settings.model_fields}
    assert set(env()) <= known, set(env()) - known
    # INTERNAL_SECRET comes from the Secret, whose placeholder the service refuses.
    secret = the("Secret")
    assert env()["INTERNAL_SECRET"] == f"secret:{secret['metadata']['name']}/INTERNAL_SECRET"
    placeholder = secret["stringData"]["INTERNAL_SECRET"]
    values = {name.lower(): value for name, value in resolved_env().items()}
    with pytest.raises(ValidationError, match="internal_secret"):
        Settings(**{**values, "internal_secret": placeholder})
    # With a real secret every value is valid, and says what the manifests assume.
    settings = Settings(**{**values, "internal_secret": "s" * 32})
    assert settings.provider_names == ["kubernetes"]
    assert settings.k8s_namespace == NAMESPACE
    [port] = container()["ports"]
    assert settings.scheduler_port == port["containerPort"]
    # The workers, pods of the same namespace, reach the Service by its name.
    service = the("Service")
    url = f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert settings.scheduler_public_url == url
    assert settings.shutdown_grace_seconds < pod_spec()["terminationGracePeriodSeconds"]


def test_sqlite_runs_one_replica_on_a_volume_replaced_whole() -> None:
    deployment = the("Deployment")
    assert env()["DATABASE_URL"].startswith("sqlite:////data/")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    [data] = [m for m in container()["volumeMounts"] if m["mountPath"] == "/data"]
    [volume] = [v for v in pod_spec()["volumes"] if v["name"] == data["name"]]
    claim = the("PersistentVolumeClaim")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_the_manifests_match_the_image() -> None:
    """The image's user, port, volume and command (Dockerfile) are the ones the
    Deployment assumes."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile)
    gid = re.search(r"groupadd .*--gid (\d+)", dockerfile)
    assert uid and gid
    security = pod_spec()["securityContext"]
    assert security["runAsUser"] == int(uid.group(1))
    assert security["runAsGroup"] == security["fsGroup"] == int(gid.group(1))
    assert re.search(r"^EXPOSE 8080$", dockerfile, flags=re.MULTILINE)
    assert container()["ports"][0]["containerPort"] == 8080
    assert re.search(r"^VOLUME /data$", dockerfile, flags=re.MULTILINE)
    assert 'ENTRYPOINT ["openalice-scheduler"]' in dockerfile
    assert container()["args"] == ["serve"]
    # The image of this version, as scripts/build-image.sh tags it.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container()["image"].split("/")[-1] == f"openalice-scheduler:{version}"


def test_the_service_and_the_probes_use_the_container_s_port() -> None:
    [port] = container()["ports"]
    service = the("Service")
    assert service["spec"]["selector"] == the("Deployment")["spec"]["selector"]["matchLabels"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container()[probe]["httpGet"]["port"] == port["name"], probe


def test_the_probes_hit_paths_the_service_serves(make_scheduler: Callable[..., Scheduler]) -> None:
    """The kubelet asks without the secret; each probe's path answers 200 on a started
    scheduler (as the kubelet counts 200-399 a success)."""
    probes = {name: container()[name]["httpGet"]["path"] for name in PROBES}
    assert probes == {
        "startupProbe": "/health",
        "livenessProbe": "/health",
        "readinessProbe": "/readyz",
    }
    sched = make_scheduler()
    for path in set(probes.values()):
        answer = httpx.get(sched.url + path, timeout=30)
        assert answer.status_code == 200, (path, answer.text)
    # A path it does not serve would have failed: the check can tell.
    assert httpx.get(sched.url + "/healthz", timeout=30).status_code == 404


PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


# --- Pod Security: the `restricted` level ------------------------------------------------


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What of a pod spec the `restricted` Pod Security level forbids (the `baseline`
    controls among them that could apply here), in the words of
    https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted ."""
    pod = spec.get("securityContext") or {}
    problems = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(f"{flag} must not be true")
    allowed_volumes = {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= allowed_volumes:
            problems.append(f"volume {volume['name']}: {sorted(kinds - allowed_volumes)}")
    for c in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        ctx = c.get("securityContext") or {}

        def either(key: str, ctx: dict[str, Any] = ctx) -> Any:
            return ctx.get(key, pod.get(key))

        name = c["name"]
        if ctx.get("privileged"):
            problems.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation must be false")
        if either("runAsNonRoot") is not True:
            problems.append(f"{name}: runAsNonRoot must be true")
        if either("runAsUser") == 0:
            problems.append(f"{name}: runAsUser must not be 0")
        seccomp = (either("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile.type must be RuntimeDefault or Localhost")
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            problems.append(f"{name}: capabilities.drop must hold ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: only NET_BIND_SERVICE may be added")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            problems.append(f"{name}: hostPort")
    return problems


def test_the_scheduler_s_pod_passes_the_restricted_pod_security_level() -> None:
    assert restricted_violations(pod_spec()) == []
    # The rule can fail: each of these is refused.
    for change in (
        lambda s: s["securityContext"].pop("runAsNonRoot"),
        lambda s: s["securityContext"].pop("seccompProfile"),
        lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda s: s["containers"][0]["securityContext"].pop("capabilities"),
        lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    ):
        spec = copy.deepcopy(pod_spec())
        change(spec)
        assert restricted_violations(spec), change
    # The namespace enforces that level (the workers' pods pass it too).
    labels = the("Namespace")["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert the("Namespace")["metadata"]["name"] == NAMESPACE


def test_the_kustomization_applies_every_manifest_but_the_placeholder_secret() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files - {"secret.yaml"}
