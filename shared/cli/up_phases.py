"""What `nori up` says while it starts: each phase it waits on, with its time, then where it
serves and a `curl` line that works as printed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def say(line: str) -> None:
    print(f"nori: {line}", flush=True)


def prepare_model_and_kernels(
    model: str, tokenizer: str | None, build_kernels: Callable[[], object] | None
) -> Path:
    """Resolves the model (a GGUF converts once, into the cache) while the C++ kernels build or
    load beside it; reports each with its time. Returns the model folder. A model error is
    raised at once; a build under way still ends (whole) before the interpreter exits."""
    from nori.models.demo import resolve_model

    def timed(work: Callable[[], object]) -> float:
        started = time.monotonic()
        work()
        return time.monotonic() - started

    pool = ThreadPoolExecutor(1, thread_name_prefix="nori-kernels")
    try:
        kernels = None if build_kernels is None else pool.submit(timed, build_kernels)
        say(f"model {model!r}: loading (a GGUF converts once, then comes from the cache)")
        started = time.monotonic()
        folder = resolve_model(model)
        if tokenizer is not None:
            resolve_model(tokenizer)
        say(f"model ready in {folder} ({time.monotonic() - started:.1f} s)")
        if kernels is not None:
            say(f"C++ CPU kernels ready ({kernels.result():.1f} s; built once per machine)")
    finally:
        pool.shutdown(wait=False)
    return folder


def curl_line(url: str, name: str, model_folder: Path | None, bearer: str | None) -> str:
    """A request that works as printed: a chat question where the model has a chat template,
    else a plain completion; `bearer`: the API key as the shell should write it."""
    auth = f' -H "Authorization: Bearer {bearer}"' if bearer is not None else ""
    if model_folder is not None and _has_chat_template(model_folder):
        body = {
            "model": name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
        endpoint = "chat/completions"
    else:
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 32}
        endpoint = "completions"
    return (
        f"curl {url}/v1/{endpoint} -H 'Content-Type: application/json'{auth} "
        f"-d '{json.dumps(body)}'"
    )


def _has_chat_template(folder: Path) -> bool:
    from nori.sampling.tokenizer import TokenizerLoadError, chat_template_of

    try:
        return bool(chat_template_of(folder))
    except TokenizerLoadError:
        return False
