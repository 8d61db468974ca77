"""The decode worker process: a paged continuous-batching engine fed by KV transfers.

`colocated` turns it into the single-worker baseline: it computes prompts itself and takes no
transfers (`nori up --colocated`).
"""

from __future__ import annotations

import logging
import socket

import grpc

from nori.decode.kv_sink import DecodeKVSink
from nori.decode.servicer import DecodeServicer
from nori.engine.config import EngineConfig
from nori.settings import DEFAULT_KV_LEASE_S
from nori.state.requests import RequestStateStore
from nori.state.state_recorder import StateRecorder
from nori.transfer.base import KVReceiver
from nori.transfer.factory import make_receiver
from nori.transfer.ucx_env import confine_ucx_to
from nori.v1 import decode_pb2_grpc
from nori.worker.runtime import Worker, WorkerOptions
from nori.worker.servicer_base import BlockLayout, OutputStreams

logger = logging.getLogger(__name__)


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def kv_listen_host(host: str, advertise_host: str) -> str:
    """Where the KV receiver listens: `--host`, or, when that is a wildcard, the advertised
    address if it is one of this machine's own. Senders only ever come to the advertised
    address (it is what the reservation names), so nothing needs the other interfaces; an
    advertised address this machine cannot bind (a NAT's, a load balancer's) keeps `--host`."""
    if host not in WILDCARD_HOSTS:
        return host
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            advertise_host, 0, type=socket.SOCK_STREAM
        )[0]
        with socket.socket(family, kind) as probe:
            probe.bind((address[0], 0))
    except OSError:
        return host
    return str(address[0])


class DecodeWorker(Worker):
    service_names = ("nori.v1.DecodeService",)

    def __init__(
        self,
        options: WorkerOptions,
        engine_config: EngineConfig,
        transport: str | None = None,
        transfer_port: int = 0,
        lease_s: float = DEFAULT_KV_LEASE_S,
        colocated: bool = False,
        queue_timeout_s: float = 60.0,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.role = "colocated" if colocated else "decode"
        super().__init__(options, engine_config)
        self.transport = transport
        self.transfer_port = transfer_port
        self.lease_s = lease_s
        self.queue_timeout_s = queue_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.colocated = colocated
        self._receiver: KVReceiver | None = None
        self._sink: DecodeKVSink | None = None
        self._servicer: DecodeServicer | None = None

    async def start_role(self) -> None:
        streams = OutputStreams()
        core = await self.start_engine(streams.dispatch)
        engine = core.facts
        assert self.redis is not None
        states = StateRecorder(RequestStateStore(self.redis, self.keys))
        if not self.colocated:
            # Under tensor parallelism the cache is split over processes: blocks arrive in a
            # staging copy, which the engine then scatters to the ranks.
            staging = (
                [BlockLayout(dtype, shape) for dtype, shape in engine.kv_block_layouts]
                if engine.tensor_parallel_size > 1
                else None
            )
            self._sink = DecodeKVSink(
                engine.kv_cache_tensors,
                staging=staging,
                on_receiving=lambda request_id: states.record(
                    request_id, "transferring", decode_worker=self.worker_id
                ),
                queue_timeout_s=self.queue_timeout_s,
                transfer_timeout_s=self.transfer_timeout_s,
            )
            # Before UCX starts: a loopback worker keeps UCX's own sockets on loopback.
            confine_ucx_to(self.options.host)
            self._receiver = make_receiver(self.transport, self._sink)
            advertise_host = self.options.resolved_advertise_host()
            self.transfer_address = await self._receiver.start(
                host=kv_listen_host(self.options.host, advertise_host),
                port=self.transfer_port,
                advertise_host=advertise_host,
            )
        self._servicer = DecodeServicer(
            worker_id=self.worker_id,
            engine=core,
            streams=streams,
            sink=self._sink,
            states=states,
            transfer_address=self.transfer_address,
            lease_s=self.lease_s,
            is_draining=lambda: self.draining,
            telemetry=self.telemetry,
            max_open_calls=self.options.max_open_calls(self.engine_config.max_num_seqs),
        )

    def add_servicers(self, server: grpc.aio.Server) -> None:
        assert self._servicer is not None
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self._servicer, server)

    def transfers_in_flight(self) -> int:
        return self._sink.num_receiving() if self._sink is not None else 0

    def transfer_counts(self) -> dict[str, int]:
        return {"kv_bytes_received": self._sink.bytes_received if self._sink is not None else 0}

    async def stop_role(self) -> None:
        if self._receiver is not None:
            await self._receiver.close()
        if self._engine is not None:
            await self._engine.stop()
