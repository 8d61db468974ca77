"""What one `nori bench serve` run does: the frozen settings, checked once when built.

Names and defaults follow `vllm bench serve` where it has the option (request rate, burstiness,
random lengths, range ratio), so that runs against Nori and against vLLM read the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

DATASETS = ("random", "sharegpt", "prefix", "mixed", "copy")
ENDPOINT_PATHS = MappingProxyType(
    {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
)
PROMPT_FORMATS = ("text", "token-ids")
DEMO_TOKENIZER = "demo"
# A "long" prompt of the mixed dataset must be long enough that its prefill visibly stalls the
# decode steps of a colocated server, which is what the mixed dataset is there to show.
MIN_LONG_INPUT_LEN = 1000


# The fields that name the server rather than the workload (`nori bench compare` sets them).
SERVER_FIELDS = ("base_url", "endpoint_type", "model", "tokenizer", "metrics_urls")


@dataclass(frozen=True)
class ServeBenchSettings:
    # The server.
    base_url: str = "http://127.0.0.1:8000"
    endpoint_type: str = "completions"
    # None: the first model the server lists at GET /v1/models.
    model: str | None = None
    # None: `model` when it is a local folder, else the demo tokenizer.
    tokenizer: str | None = None
    # Prometheus endpoints whose speculative decoding counters are read before and after the
    # run; empty: the server's own `{base_url}/metrics` (a Nori gateway's carries every worker's).
    metrics_urls: tuple[str, ...] = ()

    # The requests.
    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 1000
    # Send for this long (cycling the dataset), then wait for the requests in flight.
    duration_s: float | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    prompt_format: str = "text"
    prefix_num_groups: int = 4
    prefix_len: int = 512
    suffix_len: int = 64
    prefix_output_len: int = 128
    # The mixed dataset's long requests: prompt lengths uniform in
    # [long_input_len*(1-r), long_input_len*(1+r)] (r: long_range_ratio), long_output_len tokens.
    long_input_len: int = 1500
    long_range_ratio: float = 0.0
    long_output_len: int = 16
    # Long requests per second on a Poisson clock of their own, beside the short ones...
    long_request_rate: float = 0.5
    # ... or, when set, this fraction of the main arrival process's requests (the rest short):
    # the request rate then sets the rate of both classes.
    long_fraction: float | None = None
    # The copy dataset: the longest prompt (instruction and document), and every max_tokens.
    copy_input_len: int = 1024
    copy_output_len: int = 256
    # Drop ShareGPT conversations that would not fit the server's context.
    max_model_len: int | None = None

    # When they are sent.
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0

    # How they are sampled and judged.
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout_s: float = 3600.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if self.endpoint_type not in ENDPOINT_PATHS:
            raise ValueError(f"--endpoint-type must be one of {', '.join(ENDPOINT_PATHS)}")
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}")
        if self.prompt_format == "token-ids" and self.endpoint_type == "chat":
            raise ValueError("--prompt-format token-ids needs --endpoint-type completions")
        if self.dataset in ("sharegpt", "copy") and not self.dataset_path:
            raise ValueError(f"--dataset {self.dataset} needs --dataset-path FILE (ShareGPT)")
        self._check_counts()
        self._check_rates()
        self._check_lengths()

    def _check_counts(self) -> None:
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if self.num_warmups < 0:
            raise ValueError("--num-warmups must be >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.duration_s is not None:
            if self.duration_s <= 0:
                raise ValueError("--duration must be > 0")
            if math.isinf(self.request_rate) and self.max_concurrency is None:
                # Otherwise "send for S seconds" means an unbounded burst at time zero.
                raise ValueError("--duration needs a finite --request-rate or --max-concurrency")

    def _check_rates(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if not (0 < self.long_request_rate < math.inf):
            raise ValueError("--long-request-rate must be a finite rate > 0")
        if self.long_fraction is not None and not 0 < self.long_fraction < 1:
            raise ValueError("--long-fraction must be in (0, 1)")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")
        for name, slo in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tpot-ms", self.slo_tpot_ms)):
            if slo is not None and not slo > 0:
                raise ValueError(f"{name} must be > 0")

    def _check_lengths(self) -> None:
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if self.prefix_num_groups < 1 or self.prefix_len < 1 or self.suffix_len < 1:
            raise ValueError("--prefix-num-groups, --prefix-len and --suffix-len must be >= 1")
        if self.prefix_output_len < 1 or self.long_output_len < 1:
            raise ValueError("--prefix-output-len and --long-output-len must be >= 1")
        if self.copy_input_len < 1 or self.copy_output_len < 1:
            raise ValueError("--copy-input-len and --copy-output-len must be >= 1")
        if not 0 <= self.long_range_ratio < 1:
            raise ValueError("--long-range-ratio must be in [0, 1)")
        if math.floor(self.long_input_len * (1 - self.long_range_ratio)) < MIN_LONG_INPUT_LEN:
            raise ValueError(
                f"--long-input-len must be >= {MIN_LONG_INPUT_LEN}, and so must "
                "the shortest long prompt: --long-input-len * (1 - --long-range-ratio)"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")

    @property
    def endpoint_path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint_type]

    @property
    def server_metrics_urls(self) -> tuple[str, ...]:
        return self.metrics_urls or (f"{self.base_url}/metrics",)

    def tokenizer_for(self, model: str) -> str:
        """The tokenizer to load: --tokenizer, else the model when it is a local folder."""
        if self.tokenizer:
            return self.tokenizer
        return model if Path(model).expanduser().is_dir() else DEMO_TOKENIZER

    def echo(self, model: str) -> dict[str, object]:
        """The settings a result is read against, under vLLM's result-file names."""
        return {
            "base_url": self.base_url,
            "endpoint_type": self.endpoint_type,
            "model": model,
            "tokenizer": self.tokenizer_for(model),
            "dataset": self.dataset,
            "dataset_path": self.dataset_path,
            "prompt_format": self.prompt_format,
            **self._dataset_options(),
            "num_prompts": self.num_prompts,
            "duration_s": self.duration_s,
            "request_rate": json_number(self.request_rate),
            "burstiness": json_number(self.burstiness),
            "max_concurrency": self.max_concurrency,
            "num_warmups": self.num_warmups,
            "seed": self.seed,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "slo_ttft_ms": self.slo_ttft_ms,
            "slo_tpot_ms": self.slo_tpot_ms,
        }

    def _dataset_options(self) -> dict[str, object]:
        """Only the length options the chosen dataset reads."""
        random: dict[str, object] = {
            "random_input_len": self.random_input_len,
            "random_output_len": self.random_output_len,
            "random_range_ratio": self.random_range_ratio,
        }
        if self.dataset == "random":
            return random
        if self.dataset == "prefix":
            return {
                "prefix_num_groups": self.prefix_num_groups,
                "prefix_len": self.prefix_len,
                "suffix_len": self.suffix_len,
                "prefix_output_len": self.prefix_output_len,
            }
        if self.dataset == "mixed":
            arrivals: dict[str, object] = (
                {"long_request_rate": self.long_request_rate}
                if self.long_fraction is None
                else {"long_fraction": self.long_fraction}
            )
            return {
                **random,
                "long_input_len": self.long_input_len,
                "long_range_ratio": self.long_range_ratio,
                "long_output_len": self.long_output_len,
                **arrivals,
            }
        if self.dataset == "copy":
            return {
                "copy_input_len": self.copy_input_len,
                "copy_output_len": self.copy_output_len,
                "max_model_len": self.max_model_len,
            }
        return {"max_model_len": self.max_model_len}


def json_number(value: float) -> float | str:
    """Infinity as the string "inf", as vLLM's result files write an unlimited request rate
    (strict JSON has no infinity)."""
    return "inf" if math.isinf(value) else value
