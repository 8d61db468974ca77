"""The cluster secret, and every credential the roles derive from it.

One secret (`--cluster-secret`/`NORI_CLUSTER_SECRET`), never sent: each use gets its own key
(HMAC-SHA256 of the secret over the use's name). No secret: an open cluster (docs/operations.md)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

CLUSTER_SECRET_ENV = "NORI_CLUSTER_SECRET"
RPC_TOKEN_METADATA = "x-nori-cluster-token"
# Shorter secrets are refused: an HMAC key should carry at least 128 bits.
MIN_SECRET_CHARS = 16


def generate_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def random_token() -> str:
    """An unguessable one-off token (128 bits, hex), e.g. a KV reservation's transfer token."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class ClusterAuth:
    """A cluster's credentials; `ClusterAuth.open()` is a cluster without a secret."""

    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"the cluster secret must be at least {MIN_SECRET_CHARS} characters "
                f"(got {len(self.secret)}); `nori cluster-secret` prints a fresh one"
            )

    @classmethod
    def open(cls) -> ClusterAuth:
        return cls(None)

    @classmethod
    def from_text(cls, text: str | None) -> ClusterAuth:
        """From --cluster-secret / NORI_CLUSTER_SECRET, stripped; None or empty: an open cluster."""
        text = (text or "").strip()
        return cls(text.encode()) if text else cls.open()

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def key(self, purpose: str) -> bytes:
        if self.secret is None:
            raise RuntimeError("an open cluster has no keys")
        return hmac.new(self.secret, b"nori/" + purpose.encode(), hashlib.sha256).digest()

    def rpc_token(self) -> str:
        """The token of internal gRPC calls ("" in an open cluster)."""
        return self.key("rpc").hex() if self.enabled else ""

    def rpc_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((RPC_TOKEN_METADATA, self.rpc_token()),) if self.enabled else ()

    def check_rpc_token(self, token: str | None) -> bool:
        """Whether a call's token is this cluster's (any call passes in an open cluster)."""
        if not self.enabled:
            return True
        return token is not None and hmac.compare_digest(token, self.rpc_token())

    def sign(self, purpose: str, message: bytes) -> str:
        """A hex HMAC of `message` under the key of `purpose` ("" in an open cluster)."""
        if not self.enabled:
            return ""
        return hmac.new(self.key(purpose), message, hashlib.sha256).hexdigest()

    def verify(self, purpose: str, message: bytes, signature: str) -> bool:
        """Whether `signature` is `sign(purpose, message)` (always, in an open cluster)."""
        if not self.enabled:
            return True
        return hmac.compare_digest(signature, self.sign(purpose, message))
