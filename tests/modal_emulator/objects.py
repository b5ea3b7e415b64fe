"""The RPCs around sandboxes: hello, auth token, apps, the environment, images, secrets.

- `AppGetOrCreate`: apps by (environment, name); made on `CREATE_IF_MISSING`, else
  NOT_FOUND (`App.lookup(name, create_if_missing=...)`).
- `EnvironmentGetOrCreate`: one environment, `main` (also for the empty name), with the
  image builder version of modal 1.6.4 (`2026.10`).
- `ImageGetOrCreate` / `ImageJoinStreaming`: a registry image (`Image.from_registry`:
  a single `FROM <reference>`) is the local Docker image of that name; the emulator
  never pulls. A reference missing locally, or any build step, is a failed build (the
  client's `ImageBuildError`, with the reason). A first `ImageGetOrCreate` answers
  "not built yet", so the client joins the build stream and hears it finished; later
  ones answer the cached result, as Modal does.
- A private registry's image (`Image.from_registry(tag, secret=...)`, "To pull from a
  private registry, set the `secret` parameter to a `modal.Secret` holding registry
  credentials", https://modal.com/docs/reference/modal.Image#from_registry) names its
  secret by id in `image_registry_config`: an id the emulator does not know is
  NOT_FOUND, and the kind of credentials the client inferred from the secret's keys is
  recorded with the secret's id, never its values. The emulator pulls nothing, so the
  credentials are not tried.
- `SecretGetOrCreate`: `Secret.from_dict` (ephemeral or owned by the app) and named
  secrets (`Secret.from_name`; made by `Secret.objects.create` or the control API). A
  name not made is NOT_FOUND, which the client raises as `modal.exception.NotFoundError`
  ("Reference a deployed Secret by name", https://modal.com/docs/reference/modal.Secret#from_name;
  the message's wording is the emulator's).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import TYPE_CHECKING, Any, TypeVar

import grpclib.server
from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from .state import App, Image, new_id

if TYPE_CHECKING:
    from .auth import Credentials
    from .engine import SandboxEngine
    from .state import EmulatorState

IMAGE_BUILDER_VERSION = "2026.10"
DEFAULT_ENVIRONMENT = "main"
_THE_ENVIRONMENT = api_pb2.EnvironmentGetOrCreateResponse(  # the only one there is
    environment_id="en-" + "0" * 18 + "main",
    metadata=api_pb2.EnvironmentMetadata(
        name=DEFAULT_ENVIRONMENT,
        settings=api_pb2.EnvironmentSettings(image_builder_version=IMAGE_BUILDER_VERSION),
    ),
)
_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_CREATE = api_pb2.ObjectCreationType
Stream = grpclib.server.Stream
RequestT = TypeVar("RequestT")


async def received(stream: Stream[RequestT, Any]) -> RequestT:
    """The one request message of a unary call (the client always sends it)."""
    request = await stream.recv_message()
    assert request is not None
    return request


def environment_name(name: str) -> str:
    return name or DEFAULT_ENVIRONMENT


def _stable_id(prefix: str, text: str) -> str:
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest(), "big")
    chars = []
    for _ in range(22):
        digest, index = divmod(digest, 62)
        chars.append(_BASE62[index])
    return f"{prefix}-" + "".join(chars)


class ObjectRpcs:
    state: EmulatorState
    engine: SandboxEngine
    credentials: Credentials
    _built: set[str]

    async def ClientHello(
        self, stream: Stream[empty_pb2.Empty, api_pb2.ClientHelloResponse]
    ) -> None:
        await stream.recv_message()
        await stream.send_message(
            api_pb2.ClientHelloResponse(image_builder_version=IMAGE_BUILDER_VERSION)
        )

    async def AuthTokenGet(
        self,
        stream: Stream[api_pb2.AuthTokenGetRequest, api_pb2.AuthTokenGetResponse],
    ) -> None:
        await stream.recv_message()
        await stream.send_message(
            api_pb2.AuthTokenGetResponse(token=self.credentials.issue_token())
        )

    async def AppGetOrCreate(
        self,
        stream: Stream[api_pb2.AppGetOrCreateRequest, api_pb2.AppGetOrCreateResponse],
    ) -> None:
        request = await received(stream)
        environment = environment_name(request.environment_name)
        key = (environment, request.app_name)
        app = self.state.apps.get(key) or next(  # `App.lookup` also takes an app id
            (a for a in self.state.apps.values() if a.app_id == request.app_name), None
        )
        if app is None:
            if request.object_creation_type != _CREATE.OBJECT_CREATION_TYPE_CREATE_IF_MISSING:
                raise GRPCError(
                    Status.NOT_FOUND,
                    f"App '{request.app_name}' not found in environment '{environment}'",
                )
            app = App(app_id=new_id("ap"), name=request.app_name, environment=environment)
            self.state.apps[key] = app
        await stream.send_message(
            api_pb2.AppGetOrCreateResponse(
                app_id=app.app_id,
                handle_metadata=api_pb2.AppHandleMetadata(
                    app_id=app.app_id, description=app.name, environment_name=environment
                ),
            )
        )

    async def EnvironmentGetOrCreate(
        self,
        stream: Stream[
            api_pb2.EnvironmentGetOrCreateRequest, api_pb2.EnvironmentGetOrCreateResponse
        ],
    ) -> None:
        request = await received(stream)
        if environment_name(request.deployment_name) != DEFAULT_ENVIRONMENT:
            raise GRPCError(
                Status.NOT_FOUND,
                f"Environment '{request.deployment_name}' not found (the emulator has 'main')",
            )
        await stream.send_message(_THE_ENVIRONMENT)

    async def ImageGetOrCreate(
        self,
        stream: Stream[api_pb2.ImageGetOrCreateRequest, api_pb2.ImageGetOrCreateResponse],
    ) -> None:
        request = await received(stream)
        image = await self._image_of(request.image)
        known = self.state.images.get(image.image_id)
        image.built_at = known.built_at if known is not None else None
        self.state.images[image.image_id] = image
        response = api_pb2.ImageGetOrCreateResponse(image_id=image.image_id)
        if image.image_id in self._built:
            response.result.CopyFrom(self._build_result(image))
            response.metadata.CopyFrom(self._image_metadata())
        await stream.send_message(response)

    async def ImageJoinStreaming(
        self,
        stream: Stream[api_pb2.ImageJoinStreamingRequest, api_pb2.ImageJoinStreamingResponse],
    ) -> None:
        request = await received(stream)
        image = self.state.images.get(request.image_id)
        if image is None:
            raise GRPCError(Status.NOT_FOUND, f"Image {request.image_id} not found")
        if image.image_id not in self._built:
            self._built.add(image.image_id)
            image.built_at = time.time()
        await stream.send_message(
            api_pb2.ImageJoinStreamingResponse(
                result=self._build_result(image),
                metadata=self._image_metadata(),
                entry_id="1",
                eof=True,
            )
        )

    async def _image_of(self, definition: api_pb2.Image) -> Image:
        commands = list(definition.dockerfile_commands)
        registry = definition.image_registry_config
        if registry.secret_id and registry.secret_id not in self.state.secrets:
            raise GRPCError(Status.NOT_FOUND, f"Secret {registry.secret_id} not found")
        # Another registry secret is another image (its id changes with the secret's).
        parts = commands + ([registry.secret_id] if registry.secret_id else [])
        image_id = _stable_id("im", "\n".join(parts))
        auth = (
            api_pb2.RegistryAuthType.Name(registry.registry_auth_type)
            if registry.secret_id
            else None
        )
        image = await self._image_from(image_id, definition, commands)
        image.registry_auth, image.registry_secret_id = auth, registry.secret_id or None
        return image

    async def _image_from(
        self, image_id: str, definition: api_pb2.Image, commands: list[str]
    ) -> Image:
        if not commands or not commands[0].startswith("FROM "):
            return Image(image_id, "", "the emulator runs registry images only (FROM <image>)")
        reference = commands[0].removeprefix("FROM ").strip()
        extra = commands[1:]
        if extra or definition.base_images or definition.HasField("build_function"):
            steps = "; ".join(extra) or "a build function or base image"
            return Image(image_id, reference, f"the emulator runs images as they are: {steps}")
        if not await asyncio.to_thread(self.engine.containers.image_exists, reference):
            return Image(
                image_id,
                reference,
                f"image {reference} is not on the local Docker engine (the emulator never pulls)",
            )
        return Image(image_id, reference, None)

    def _build_result(self, image: Image) -> api_pb2.GenericResult:
        if image.error is None:
            return api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS)
        return api_pb2.GenericResult(
            status=api_pb2.GenericResult.GENERIC_STATUS_FAILURE, exception=image.error
        )

    def _image_metadata(self) -> api_pb2.ImageMetadata:
        return api_pb2.ImageMetadata(image_builder_version=IMAGE_BUILDER_VERSION)

    async def SecretGetOrCreate(
        self,
        stream: Stream[api_pb2.SecretGetOrCreateRequest, api_pb2.SecretGetOrCreateResponse],
    ) -> None:
        request = await received(stream)
        env = dict(request.env_dict)
        kind = request.object_creation_type
        environment = environment_name(request.environment_name)
        if kind in (
            _CREATE.OBJECT_CREATION_TYPE_EPHEMERAL,
            _CREATE.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP,
        ):
            secret_id = new_id("st")
            self.state.secrets[secret_id] = env
        else:
            key = (environment, request.deployment_name)
            existing = self.state.named_secrets.get(key)
            if existing is not None and kind == _CREATE.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
                raise GRPCError(
                    Status.ALREADY_EXISTS, f"Secret '{request.deployment_name}' already exists"
                )
            if existing is None or kind == _CREATE.OBJECT_CREATION_TYPE_CREATE_OVERWRITE_IF_EXISTS:
                if existing is None and kind == _CREATE.OBJECT_CREATION_TYPE_UNSPECIFIED:
                    raise GRPCError(
                        Status.NOT_FOUND, f"Secret '{request.deployment_name}' not found"
                    )
                existing = existing or new_id("st")
                self.state.secrets[existing] = env
                self.state.named_secrets[key] = existing
            secret_id = existing
            env = self.state.secrets[secret_id]
            missing = sorted(set(request.required_keys) - set(env))
            if missing:
                raise GRPCError(
                    Status.NOT_FOUND,
                    f"Secret '{request.deployment_name}' is missing keys: {', '.join(missing)}",
                )
        await stream.send_message(
            api_pb2.SecretGetOrCreateResponse(
                secret_id=secret_id,
                metadata=api_pb2.SecretMetadata(
                    name=request.deployment_name, keys=sorted(env), environment_name=environment
                ),
            )
        )
