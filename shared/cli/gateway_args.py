"""The gateway's own flags (`nori serve gateway`) beside every role's (nori.cli.serve): model and
tokenizer, admission and fairness limits, request size limits, streaming, and the Batch API."""

from __future__ import annotations

import argparse

from nori.cli.engine_args import positive_int
from nori.settings import DEFAULT_DISAGGREGATION, DEFAULT_MAX_LOCAL_COMPUTE_S, DISAGGREGATION_MODES


def add_gateway_args(gateway: argparse.ArgumentParser) -> None:
    gateway.add_argument("--model", default="demo", help="model folder (for its tokenizer)")
    gateway.add_argument(
        "--tokenizer",
        default=None,
        help="whose tokenizer and chat template to use, as --model takes it (default: the "
        "model's); give the workers the same",
    )
    gateway.add_argument("--max-model-len", type=int, default=None)
    gateway.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the workers' KV block size (default: what the workers state in the registry; "
        "a worker with another one is refused)",
    )
    gateway.add_argument("--max-in-flight", type=int, default=4096)
    gateway.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="when the decode worker streaming a request dies, continue it on another one "
        "(from the tokens already streamed) at most this many times; 0: fail it",
    )
    gateway.add_argument(
        "--stream-stall-timeout-s",
        type=float,
        default=300.0,
        help="a worker stream that sends nothing this long is taken as lost and its request "
        "moves to another worker (gRPC keepalive catches a frozen peer sooner)",
    )
    gateway.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="on SIGTERM, requests in flight get this long to finish while new ones get 503 "
        "with Retry-After; a second signal stops at once (default %(default)s)",
    )
    gateway.add_argument(
        "--group-wait-s",
        type=float,
        default=600.0,
        help="a request of several prompts (or n > 1) that finds every worker full waits up to "
        "this long for room, served in waves, instead of 429; 0: 429 at once",
    )
    gateway.add_argument(
        "--max-decode-share",
        type=float,
        default=0.5,
        help="fair shares: while other requests run or wait, one request's members and one "
        "client's (API key, else address) requests hold at most this share of the decode "
        "pool's running slots, the rest waiting in the gateway; alone, either may use all "
        "(default %(default)s)",
    )
    gateway.add_argument(
        "--max-n",
        type=int,
        default=64,
        help="the most choices per prompt (n) a request may ask for, 400 past it (at most 64)",
    )
    gateway.add_argument(
        "--max-request-members",
        type=int,
        default=4096,
        help="the most choices (prompts x n) one request may ask for, 400 past it; at most "
        "--max-in-flight counts (default %(default)s)",
    )
    gateway.add_argument(
        "--api-key",
        default=None,
        help="require this key as `Authorization: Bearer KEY` on the API (/health and /metrics "
        "stay open; default: $NORI_API_KEY, else none)",
    )
    gateway.add_argument(
        "--max-request-body-mib",
        type=float,
        default=32.0,
        help="larger request bodies are refused with 413 before they are read (the prompt "
        "endpoints take at most 64 bytes per token of the context, and at least 1 MiB)",
    )
    gateway.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no log line per HTTP request",
    )
    gateway.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) replacing the model's own, "
        "for models with none",
    )
    gateway.add_argument(
        "--max-queued-prompt-tokens",
        type=int,
        default=8192,
        help="admission: refuse new requests (429 with Retry-After) while this many prompt "
        "tokens per prefill (or colocated) worker wait for their first token; about TTFT target "
        "x prefill tokens/s; 0 = no bound (default %(default)s: four 2048-token steps)",
    )
    gateway.add_argument(
        "--disaggregation",
        choices=DISAGGREGATION_MODES,
        default=DEFAULT_DISAGGREGATION,
        help="where a prompt is computed in a disaggregated cluster: always on a prefill worker, "
        "never (on the decode worker that decodes it), or auto: per request, by what each path "
        "would cost, from the workers' measured step costs, queues and transfer rate "
        "(default %(default)s)",
    )
    gateway.add_argument(
        "--max-local-compute-s",
        type=float,
        default=DEFAULT_MAX_LOCAL_COMPUTE_S,
        help="with --disaggregation auto: a prompt whose compute on its decode worker would take "
        "longer than this (by the worker's measured step costs) always goes to a prefill "
        "worker, however the costs compare: the decode worker's streams never wait longer "
        "(default %(default)s)",
    )
    gateway.add_argument(
        "--stream-interval",
        type=positive_int,
        default=1,
        help="a streamed request's tokens reach its client this many to an event (the first "
        "output at once, the rest at the end): fewer messages for workers, gateway and client, "
        "as vLLM's and SGLang's flag (default %(default)s: every token as it comes)",
    )
    gateway.add_argument(
        "--batch-dir",
        default=None,
        metavar="DIR",
        help="serve OpenAI's Files and Batch API (/v1/files, /v1/batches), keeping files and "
        "batches in DIR (shared with the batch runners; a volume in Compose); none: off",
    )
    gateway.add_argument(
        "--max-batch-file-mib",
        type=float,
        default=200.0,
        help="larger uploads to /v1/files are refused with 413 (default %(default)s, OpenAI's)",
    )
