"""Every Redis key the cluster state uses, built in one place, all under `{namespace}:` so that
clusters sharing one Redis never see each other's state and one SCAN pattern finds a cluster's."""

from __future__ import annotations

from dataclasses import dataclass

from nori.settings import DEFAULT_NAMESPACE

# ':' separates key parts, and the rest are glob metacharacters in SCAN MATCH: a namespace holding
# one could match another cluster's keys, so they are refused rather than escaped.
_FORBIDDEN_IN_NAMESPACE = frozenset(":*?[]\\ \t\r\n")


@dataclass(frozen=True)
class Keys:
    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("the Redis key namespace must not be empty")
        bad = sorted(set(self.namespace) & _FORBIDDEN_IN_NAMESPACE)
        if bad:
            raise ValueError(f"Redis key namespace {self.namespace!r} contains {bad!r}")

    def worker(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    def worker_pattern(self) -> str:
        """SCAN MATCH pattern for every worker key of this namespace."""
        return f"{self.namespace}:worker:*"

    def worker_id_of(self, key: str) -> str:
        """The worker id a key from `worker(...)` was built from."""
        prefix = f"{self.namespace}:worker:"
        if not key.startswith(prefix):
            raise ValueError(f"{key!r} is not a worker key of namespace {self.namespace!r}")
        return key[len(prefix) :]

    def request(self, request_id: str) -> str:
        return f"{self.namespace}:request:{request_id}"

    def block(self, block_hash: bytes) -> str:
        # Hex keeps keys printable (redis-cli, logs); the hashes are only 16 bytes.
        return f"{self.namespace}:block:{block_hash.hex()}"

    def batch(self, batch_id: str, part: str) -> str:
        """One of a batch's work keys (`nori.batch.jobs`)."""
        return f"{self.namespace}:batch:{batch_id}:{part}"

    def batch_pattern(self) -> str:
        return f"{self.namespace}:batch:*"

    def pattern(self) -> str:
        """SCAN MATCH pattern for every key of this namespace (tests, cleanup)."""
        return f"{self.namespace}:*"
