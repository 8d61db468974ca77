"""The follower ranks of a tensor-parallel engine: started by rank 0, told every step.

Rank 0 schedules, samples and answers; ranks 1..N-1 are spawned processes holding their shard of
the weights and KV cache. Each step rank 0 broadcasts a `StepCommand` (flat inputs and attention
metadata), every rank runs its shard, and rank 0 samples from the gathered logits. KV hand-offs
are one command too, heads gathered on or scattered from rank 0."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nori.engine.attention_metadata import AttentionMetadata
from nori.parallel.group import TensorParallelGroup

if TYPE_CHECKING:
    from nori.engine.config import EngineConfig

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class StepCommand:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    # The hidden rows whose logits the step computes, batch by batch, in rank 0's order.
    logits_rows: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class ReadBlocks:
    block_ids: list[int]


@dataclass(frozen=True)
class WriteBlocks:
    block_ids: list[int]
    # Whole-model blocks (every kv head), as KVCache.read_blocks gives them at tensor parallel 1.
    blocks: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Stop:
    pass


Command = StepCommand | ReadBlocks | WriteBlocks | Stop


def rank_group(config: EngineConfig, rank: int) -> TensorParallelGroup:
    """Rank `rank`'s view of `config`'s group (size, and whether experts go whole or sliced)."""
    return TensorParallelGroup(
        rank, config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel
    )


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class FollowerRanks:
    def __init__(self, group: TensorParallelGroup, processes: Sequence[BaseProcess]):
        self.group = group
        self._processes = processes
        self._stopped = False
        self._finalizer = weakref.finalize(self, _stop_processes, processes)

    @classmethod
    def start(cls, config: EngineConfig, model_dir: Path, device_type: str) -> FollowerRanks:
        """Spawns the followers and joins the group as rank 0 (they load while this returns)."""
        world_size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process (torch.distributed "
                "has one group per process): close() it before starting another"
            )
        # The rendezvous port is bound here before any rank starts (no race for a free port)
        # and on loopback only, as Gloo's sockets (an operator's GLOO_SOCKET_IFNAME wins).
        listener = socket.create_server(("127.0.0.1", 0))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.TCPStore(
            "127.0.0.1",
            listener.getsockname()[1],
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=COLLECTIVE_TIMEOUT,
            master_listen_fd=listener.detach(),
        )
        # The cores this engine was given, shared out: N ranks of T/N intra-op threads each.
        threads = max(1, torch.get_num_threads() // world_size)
        torch.set_num_threads(threads)
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(
                target=follower_main,
                args=(rank, store.port, config, model_dir, device_type, os.getpid(), threads),
                name=f"nori-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        for process in processes:
            process.start()
        try:
            dist.init_process_group(
                backend_for(device_type),
                store=store,
                rank=0,
                world_size=world_size,
                timeout=COLLECTIVE_TIMEOUT,
            )
        except Exception:
            _stop_processes(processes)
            raise
        logger.info("tensor parallel: %d ranks (%s)", world_size, backend_for(device_type))
        return cls(rank_group(config, 0), processes)

    def send(self, command: Command) -> None:
        self.group.broadcast_object(command)

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self.send(Stop())
        for process in self._processes:
            process.join(timeout=10)
        self._finalizer()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _stop_processes(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def follower_main(
    rank: int,
    store_port: int,
    config: EngineConfig,
    model_dir: Path,
    device_type: str,
    parent_pid: int,
    threads: int,
) -> None:
    """A follower rank's whole life: join, load its shard, follow rank 0's commands."""
    from nori.engine.model_runner import ModelRunner
    from nori.parent_death import exit_with_parent

    exit_with_parent(parent_pid, signal.SIGKILL)
    world_size = config.tensor_parallel_size
    torch.set_num_threads(threads)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    store = dist.TCPStore(
        "127.0.0.1", store_port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT
    )
    dist.init_process_group(
        backend_for(device_type),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    runner = ModelRunner(config, model_dir, rank=rank)
    group = rank_group(config, rank)
    try:
        while True:
            command = group.broadcast_object()
            if isinstance(command, Stop):
                break
            runner.follow(command)  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
