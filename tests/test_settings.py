"""The environment variables Nori reads, read in one place."""

from __future__ import annotations

from pathlib import Path

from nori.gateway.server import GatewayOptions
from nori.settings import DEFAULT_NAMESPACE, DEFAULT_REDIS_URL, Environment, RoleSettings
from nori.worker.runtime import WorkerOptions


def test_environment_reads_each_variable_and_treats_empty_as_unset() -> None:
    env = Environment.read(
        {
            "REDIS_URL": "redis://r:1/0",
            "NORI_ADVERTISE_HOST": "auto",
            "NORI_CACHE_DIR": "/tmp/models",
            "NORI_CPU_KERNELS": "0",
        }
    )
    assert env == Environment("redis://r:1/0", "auto", Path("/tmp/models"), cpu_kernels=False)
    assert Environment.read({"REDIS_URL": "", "NORI_CACHE_DIR": ""}) == Environment()
    assert Environment.read({}).cpu_kernels


def test_roles_share_one_settings_base_and_its_defaults() -> None:
    worker = WorkerOptions()
    gateway = GatewayOptions(model="demo", served_model_name="demo")
    for settings in (worker, gateway):
        assert isinstance(settings, RoleSettings)
        assert (settings.redis_url, settings.namespace) == (DEFAULT_REDIS_URL, DEFAULT_NAMESPACE)
