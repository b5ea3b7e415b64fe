"""What the kubelet's image manager says before it pulls, and of a pull that failed for a
while (kubernetes/kubernetes pkg/kubelet/images/image_manager.go, EnsureImageExists; the
waiting reasons: https://kubernetes.io/docs/concepts/containers/images/#imagepullbackoff).

- An image reference that does not parse (the grammar of
  github.com/distribution/reference, `reference.go`): waiting `InvalidImageName`, `Failed
  to apply default image tag "X": couldn't parse image name "X": invalid reference
  format`; never pulled, never tried again.
- `imagePullPolicy: Never` and the image not on the node: waiting `ErrImageNeverPull`,
  `Container image "X" is not present with pull policy of Never`; never pulled.
- A pull that fails and then succeeds (`set_flaky_pulls`): each failure is `ErrImagePull`
  (here a registry's rate limit, the usual transient one), then `ImagePullBackOff` until
  the kubelet's backoff lets it try again; the backoff is per pod and image.
"""

from __future__ import annotations

import re
from typing import Any

_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_PATH_PART}(?:/{_PATH_PART})*(?::{_TAG})?(?:@{_DIGEST})?"
)


def invalid_name(image: str) -> str | None:
    """The kubelet's message for an image reference that does not parse, or None."""
    if _REFERENCE.fullmatch(image):
        return None
    return (
        f'Failed to apply default image tag "{image}": couldn\'t parse image name '
        f'"{image}": invalid reference format'
    )


def never_pull(container: dict[str, Any]) -> bool:
    return container.get("imagePullPolicy") == "Never"


def never_pull_message(image: str) -> str:
    return f'Container image "{image}" is not present with pull policy of Never'


def rate_limited_message(image: str) -> str:
    """A pull refused by the registry's rate limit (Docker Hub's words), which passes."""
    return (
        f'Failed to pull image "{image}": rpc error: code = Unknown desc = failed to pull and '
        f'unpack image "{image}": failed to copy: httpReadSeeker: failed open: unexpected '
        "status code 429 Too Many Requests - Server message: toomanyrequests: You have "
        "reached your pull rate limit"
    )
