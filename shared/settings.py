"""What every role shares: the roles, each default in one place, the settings base, and the
environment (`Environment.read`): REDIS_URL, NORI_ADVERTISE_HOST (`auto`: this host's address),
NORI_CACHE_DIR (built-in models), NORI_CPU_KERNELS=0 (PyTorch references, not the C++ kernels),
NORI_API_KEY, NORI_CLUSTER_SECRET and NORI_REDIS_PASSWORD (or the file each `*_FILE` names)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

# A worker's role in the registry, which the gateway routes by.
WorkerRole = Literal["prefill", "decode", "colocated"]
Role = Literal["gateway", "prefill", "decode", "colocated", "batch"]
WORKER_ROLES: tuple[WorkerRole, ...] = get_args(WorkerRole)
# Where a disaggregated cluster computes a prompt (--disaggregation; nori.gateway.disaggregation).
DisaggregationMode = Literal["auto", "always", "never"]
DISAGGREGATION_MODES: tuple[DisaggregationMode, ...] = get_args(DisaggregationMode)
# Unless --disaggregation says otherwise: each prompt where it costs less, by measured costs.
DEFAULT_DISAGGREGATION: DisaggregationMode = "auto"
# --max-local-compute-s: the most decode-worker compute one prompt may take under auto.
DEFAULT_MAX_LOCAL_COMPUTE_S = 0.1

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# Redis keys of one cluster start with it: clusters can share a Redis.
DEFAULT_NAMESPACE = "nori"
DEFAULT_BLOCK_SIZE = 16
# What `nori up`, `generate`, `run-batch` and `bench` serve without --model (a PyPI package's GGUF).
DEFAULT_MODEL = "smollm2-135m-instruct"
# How long a decode worker holds a prompt's blocks without a renewal from its prefill worker.
DEFAULT_KV_LEASE_S = 10.0
# Batch lines' priority (lower is served first; 0 is interactive).
BATCH_PRIORITY = 1000


@dataclass(frozen=True, kw_only=True)
class RoleSettings:
    """The base of each role's settings: where the cluster meets."""

    redis_url: str = DEFAULT_REDIS_URL
    namespace: str = DEFAULT_NAMESPACE
    cluster_secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Environment:
    redis_url: str | None = None
    advertise_host: str | None = None
    cache_dir: Path | None = None
    cpu_kernels: bool = True
    api_key: str | None = None
    cluster_secret: str | None = field(default=None, repr=False)
    redis_password: str | None = field(default=None, repr=False)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Environment:
        env = os.environ if environ is None else environ
        cache_dir = env.get("NORI_CACHE_DIR")
        return cls(
            redis_url=env.get("REDIS_URL") or None,
            advertise_host=env.get("NORI_ADVERTISE_HOST") or None,
            cache_dir=Path(cache_dir) if cache_dir else None,
            cpu_kernels=env.get("NORI_CPU_KERNELS", "1") != "0",
            api_key=_secret(env, "NORI_API_KEY"),
            cluster_secret=_secret(env, "NORI_CLUSTER_SECRET"),
            redis_password=_secret(env, "NORI_REDIS_PASSWORD"),
        )


def _secret(env: Mapping[str, str], name: str) -> str | None:
    """`name` from the environment, else the file `name_FILE` points at (a Compose secret)."""
    value = env.get(name)
    if value:
        return value.strip()
    path = env.get(f"{name}_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as error:
        raise ValueError(f"{name}_FILE={path}: cannot read it ({error.strerror})") from None


SettingsT = TypeVar("SettingsT")


def settings_from(
    cls: type[SettingsT], source: object, *, exclude: Collection[str] = (), **overrides: Any
) -> SettingsT:
    """A settings dataclass from the attributes of `source` (an argparse namespace or other
    settings) named like its fields; `overrides` give the fields named or shaped differently,
    and fields `source` lacks, or in `exclude`, keep their defaults."""
    values = {
        field.name: getattr(source, field.name)
        for field in fields(cls)  # type: ignore[arg-type]
        if field.init and field.name not in exclude and hasattr(source, field.name)
    }
    values.update(overrides)
    return cls(**values)
