"""Each kind's image resolved ahead of any acquire (docs/backends/modal.md#images-resolved-ahead):
built by Modal, or looked up when Modal built it already, once the provider has connected
(at start-up: the start-up reconciliation connects), in the background, so that no
caller's acquire pays for a build.

- An acquire arriving while its image's resolution still runs waits for that one (it
  never starts one); once resolved, a create names the image by its id, with no call
  about the image (modal 1.6.4, `sandbox/_common.py`: "An already-hydrated image ...
  has nothing to load").
- A resolution that failed is logged at once (a warning naming the image and Modal's
  reason) and is the reason `modal` gives for the kinds of that image (a 503 when no
  other provider serves) until a later attempt succeeds: one is started in the
  background by an acquire at most every RETRY_AFTER_S.
- MODAL_REGISTRY_SECRET names the Modal secret with a private registry's credentials,
  given to `Image.from_registry(tag, secret=Secret.from_name(name))`; its values stay
  in Modal, no message here carries them (only the secret's name)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import modal
import modal.exception

log = logging.getLogger(__name__)

# A failed resolution is tried again, in the background, at most this often.
RETRY_AFTER_S = 10.0


@dataclass
class _Resolution:
    image: modal.Image | None = None
    error: str | None = None
    finished_at: float | None = None
    task: asyncio.Task[None] | None = None  # the attempt under way, or the last one


class ImageResolver:
    """The images of the kinds (`references`: kind -> registry reference)."""

    def __init__(
        self,
        references: Mapping[str, str],
        registry_secret: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.references = dict(references)
        self.registry_secret = registry_secret
        self._clock = clock
        self._resolutions = {ref: _Resolution() for ref in set(self.references.values())}

    def start(self, client: modal.Client, app: modal.App) -> None:
        """Resolve, in the background, each image not resolved yet (unless under way),
        each on its own: a kind waits for its own image only."""
        for reference, found in self._resolutions.items():
            if found.image is None and (found.task is None or found.task.done()):
                found.task = asyncio.create_task(self._resolve(reference, found, client, app))

    def problem(self, kind: str, client: modal.Client, app: modal.App) -> str | None:
        """Why `kind`'s image cannot be used (its last resolution failed), starting a new
        attempt in the background when the last one is old enough; None otherwise."""
        reference = self.references[kind]
        found = self._resolutions[reference]
        if found.error is None:
            return None
        if found.finished_at is not None and self._clock() - found.finished_at >= RETRY_AFTER_S:
            self.start(client, app)
        return found.error

    async def image(self, kind: str) -> modal.Image:
        """`kind`'s resolved image, waiting for a resolution under way. LookupError with
        the reason when it failed (or none was started: the provider never connected)."""
        reference = self.references[kind]
        found = self._resolutions[reference]
        if found.image is None and found.task is not None:
            await asyncio.shield(found.task)
        if found.image is None:
            raise LookupError(found.error or f"Modal image {reference} is not resolved yet")
        return found.image

    async def close(self) -> None:
        tasks = [f.task for f in self._resolutions.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _resolve(
        self, reference: str, found: _Resolution, client: modal.Client, app: modal.App
    ) -> None:
        started = time.perf_counter()
        try:
            found.image = await self._build(reference, client, app)
            found.error = None
            log.info("modal: image %s resolved in %.1f s", reference, time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - whatever it was is the kinds' reason
            found.error = f"Modal image {reference} could not be resolved: " + _why(
                exc, self.registry_secret
            )
            log.warning("modal: %s", found.error)
        found.finished_at = self._clock()

    async def _build(self, reference: str, client: modal.Client, app: modal.App) -> modal.Image:
        secret = None
        if self.registry_secret is not None:
            secret = modal.Secret.from_name(self.registry_secret, client=client)
        image = modal.Image.from_registry(reference, secret=secret)
        # Built (or looked up, when Modal has it) in the app, as a create would.
        await image.build.aio(app)
        return image


def _why(exc: BaseException, registry_secret: str | None) -> str:
    """Modal's reason, in a sentence (the client's messages name the object, never a
    secret's values; a registry secret's are never sent to the scheduler at all)."""
    text = f"{type(exc).__name__}: {str(exc)[:300]}"
    if registry_secret is not None and isinstance(exc, modal.exception.NotFoundError):
        text += f" (MODAL_REGISTRY_SECRET names the Modal secret {registry_secret!r})"
    return text
