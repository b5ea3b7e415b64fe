"""Credentials as Modal checks them: every call carries `x-modal-token-id` and
`x-modal-token-secret`; the V2 sandbox calls also carry `x-modal-auth-token`, a short
lived JWT from `AuthTokenGet` whose `exp` the client reads to know when to refresh it.

The emulator signs its JWTs (HS256, a key of its own) and accepts only its own,
unexpired ones. Wrong or missing credentials answer UNAUTHENTICATED (the client's
`AuthError`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping

from grpclib import GRPCError, Status

AUTH_TOKEN_TTL = 3600.0
# The calls that need `x-modal-auth-token` besides the token pair: the ones the client
# sends it with (sandbox/_impl_v2.py).
_NEEDS_AUTH_TOKEN_SUFFIX = "V2"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Credentials:
    def __init__(self, token_id: str, token_secret: str) -> None:
        self.token_id = token_id
        self._token_secret = token_secret
        self._key = secrets.token_bytes(32)
        self.tokens_issued = 0

    def issue_token(self, now: float | None = None) -> str:
        """A JWT with `exp` (real time: the client compares it with its own clock)."""
        issued = time.time() if now is None else now
        header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        payload = _b64(
            json.dumps(
                {"sub": self.token_id, "iat": int(issued), "exp": int(issued + AUTH_TOKEN_TTL)}
            ).encode()
        )
        signature = hmac.new(self._key, f"{header}.{payload}".encode(), hashlib.sha256)
        self.tokens_issued += 1
        return f"{header}.{payload}.{_b64(signature.digest())}"

    def _token_valid(self, token: str) -> bool:
        try:
            header, payload, signature = token.split(".")
            expected = hmac.new(self._key, f"{header}.{payload}".encode(), hashlib.sha256)
            if not hmac.compare_digest(_unb64(signature), expected.digest()):
                return False
            claims = json.loads(_unb64(payload))
        except ValueError:
            return False
        return bool(claims.get("sub") == self.token_id and claims.get("exp", 0) > time.time())

    def check(self, rpc: str, metadata: Mapping[str, object]) -> None:
        """Raise UNAUTHENTICATED unless the call's credentials are this emulator's."""
        token_id = metadata.get("x-modal-token-id")
        token_secret = metadata.get("x-modal-token-secret")
        if not isinstance(token_id, str) or not isinstance(token_secret, str):
            raise GRPCError(Status.UNAUTHENTICATED, f"No credentials for method {rpc}")
        id_ok = hmac.compare_digest(token_id.encode(), self.token_id.encode())
        secret_ok = hmac.compare_digest(token_secret.encode(), self._token_secret.encode())
        if not (id_ok and secret_ok):
            raise GRPCError(Status.UNAUTHENTICATED, "Token validation failed: invalid token")
        if rpc.endswith(_NEEDS_AUTH_TOKEN_SUFFIX):
            auth_token = metadata.get("x-modal-auth-token")
            if not isinstance(auth_token, str) or not self._token_valid(auth_token):
                raise GRPCError(Status.UNAUTHENTICATED, f"Missing or invalid auth token for {rpc}")
