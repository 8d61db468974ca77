"""The batch-job benchmark's input: ShareGPT conversations as an OpenAI batch file, and the
same file as an offline workload, so `nori run-batch` and `nori bench offline` run exactly the
same requests.

Each line is a completions request whose prompt is the first human turn's token ids (as the
model's tokenizer encodes it) and whose `max_tokens` is the token length of the answer that
followed it, capped (256 by default), greedy and with `ignore_eos`, as vLLM's throughput
benchmark runs ShareGPT: every line produces exactly its `max_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nori.bench.offline import OfflineWorkload
from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.sharegpt import sharegpt_requests
from nori.models.demo import resolve_model
from nori.sampling.tokenizer import Tokenizer


def write_sharegpt_batch_file(
    sharegpt_path: Path,
    output: Path,
    model: str,
    served_model_name: str,
    num_prompts: int,
    max_tokens_cap: int = 256,
    seed: int = 0,
) -> int:
    """Writes the batch file; the number of lines."""
    tokenizer = Tokenizer.from_dir(resolve_model(model))
    maker = PromptMaker.create(tokenizer, "token-ids")
    specs = sharegpt_requests(sharegpt_path, maker, np.random.default_rng(seed), num_prompts)
    with output.open("w") as out:
        for index, spec in enumerate(specs):
            body = {
                "model": served_model_name,
                "prompt": list(maker.from_text(spec.prompt).ids)
                if isinstance(spec.prompt, str)
                else list(spec.prompt),
                "max_tokens": min(spec.max_tokens, max_tokens_cap),
                "temperature": 0,
                "ignore_eos": True,
            }
            line = {"custom_id": f"sharegpt-{index}", "method": "POST", "url": "/v1/completions"}
            out.write(json.dumps({**line, "body": body}) + "\n")
    return len(specs)


def workload_from_batch_file(path: Path) -> OfflineWorkload:
    """The file's completions lines with token-id prompts, as an offline workload."""
    prompts: list[list[int]] = []
    output_lens: list[int] = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        if not raw.strip():
            continue
        body = json.loads(raw).get("body", {})
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError(f"{path} line {number}: the offline benchmark takes token-id prompts")
        if not body.get("ignore_eos") or body.get("temperature", 1) != 0:
            raise ValueError(f"{path} line {number}: needs temperature 0 and ignore_eos")
        prompts.append(prompt)
        output_lens.append(int(body["max_tokens"]))
    if not prompts:
        raise ValueError(f"{path}: no requests")
    return OfflineWorkload(prompts, output_lens)
