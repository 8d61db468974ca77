"""The request specs of a run, for each dataset: random, sharegpt, prefix, mixed and copy.

- random: prompt and output lengths uniform in [len*(1-r), len*(1+r)] (vLLM's
  --random-range-ratio), prompts of random vocabulary.
- sharegpt: real conversations (see `sharegpt.py`).
- prefix: groups of requests that share one long prefix, token for token, then a random
  suffix each: what a prefix cache is measured with.
- mixed: short requests of the random dataset's lengths ("short") and long prompts with short
  outputs ("long"): the long prefills are what stall the short requests' decoding on a
  colocated server. The long ones arrive on their own Poisson clock (--long-request-rate), or,
  with --long-fraction F, they are that fraction of the main arrival process's requests, so
  that --request-rate scales both classes.
- copy: instructions to summarise, quote or rewrite a document given in the prompt (ShareGPT
  answers): what speculative decoding from the prompt is measured with (see `copy_dataset.py`).

Everything is drawn from one numpy generator seeded with --seed, so a seed gives the same
prompts, in the same order, every time.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from nori.bench.serve.copy_dataset import copy_requests
from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.settings import ServeBenchSettings
from nori.bench.serve.sharegpt import sharegpt_requests
from nori.bench.serve.specs import RequestSpec, Workload
from nori.sampling.tokenizer import Tokenizer

# Separate seed streams: one for the dataset, one per long request of the mixed dataset.
_DATASET_STREAM = 0
_LONG_STREAM = 1


def sample_lengths(
    rng: np.random.Generator, count: int, length: int, range_ratio: float, minimum: int = 1
) -> list[int]:
    """Integers uniform in [floor(length*(1-r)), ceil(length*(1+r))], never below `minimum`."""
    low = max(minimum, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def random_requests(
    maker: PromptMaker,
    rng: np.random.Generator,
    count: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    request_class: str = "random",
) -> list[RequestSpec]:
    input_lens = sample_lengths(rng, count, input_len, range_ratio, maker.min_length)
    output_lens = sample_lengths(rng, count, output_len, range_ratio)
    specs = []
    for prompt_len, max_tokens in zip(input_lens, output_lens, strict=True):
        prompt = maker.random_prompt(rng, prompt_len)
        specs.append(RequestSpec(prompt.value, prompt.length, max_tokens, request_class))
    return specs


def prefix_requests(
    maker: PromptMaker,
    rng: np.random.Generator,
    count: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
) -> list[RequestSpec]:
    """Requests dealt round-robin to `num_groups` prefixes of `prefix_len` tokens (special
    tokens included), each with its own `suffix_len` random tokens, then shuffled so that the
    groups interleave in arrival order."""
    prefixes = [
        maker.random_prompt(rng, max(prefix_len, maker.min_length)) for _ in range(num_groups)
    ]
    specs = []
    for index in range(count):
        prompt = maker.extend(rng, prefixes[index % num_groups], suffix_len)
        specs.append(RequestSpec(prompt.value, prompt.length, output_len, "prefix"))
    return [specs[int(i)] for i in rng.permutation(count)]


def long_request(
    maker: PromptMaker,
    seed: int,
    input_len: int,
    range_ratio: float,
    output_len: int,
    index: int,
) -> RequestSpec:
    """The mixed dataset's `index`-th long request of its own clock, the same for the same seed
    and index."""
    rng = np.random.default_rng((seed, _LONG_STREAM, index))
    (length,) = sample_lengths(rng, 1, input_len, range_ratio, maker.min_length)
    prompt = maker.random_prompt(rng, length)
    return RequestSpec(prompt.value, prompt.length, output_len, "long")


def long_positions(rng: np.random.Generator, count: int, fraction: float) -> list[bool]:
    """Which of `count` requests are long: exactly round(count * fraction) of them, at random
    places (a run that sends only part of them, with --duration, sends about that fraction)."""
    longs = round(count * fraction)
    return [bool(index < longs) for index in rng.permutation(count)]


def mixed_requests(
    maker: PromptMaker, rng: np.random.Generator, settings: ServeBenchSettings, count: int
) -> list[RequestSpec]:
    """--long-fraction: `count` short and long requests on one arrival process, the long ones
    that fraction of them."""
    assert settings.long_fraction is not None
    is_long = long_positions(rng, count, settings.long_fraction)
    shorts = iter(
        random_requests(
            maker,
            rng,
            is_long.count(False),
            settings.random_input_len,
            settings.random_output_len,
            settings.random_range_ratio,
            request_class="short",
        )
    )
    long_lens = sample_lengths(
        rng, is_long.count(True), settings.long_input_len, settings.long_range_ratio
    )
    longs = iter(long_lens)
    specs = []
    for long in is_long:
        if not long:
            specs.append(next(shorts))
            continue
        prompt = maker.random_prompt(rng, next(longs))
        specs.append(RequestSpec(prompt.value, prompt.length, settings.long_output_len, "long"))
    return specs


def build_workload(settings: ServeBenchSettings, tokenizer: Tokenizer) -> Workload:
    """The run's requests and its warm-ups (drawn like the requests, but distinct from them,
    so that a warm-up does not put a measured prompt into the server's prefix cache)."""
    maker = PromptMaker.create(tokenizer, settings.prompt_format)
    rng = np.random.default_rng((settings.seed, _DATASET_STREAM))
    count = settings.num_prompts + settings.num_warmups
    background = None
    # The mixed dataset's short requests are the random dataset's, under another class name.
    random_lengths = (settings.random_input_len, settings.random_output_len)
    if settings.dataset == "random":
        specs = random_requests(maker, rng, count, *random_lengths, settings.random_range_ratio)
    elif settings.dataset == "sharegpt":
        assert settings.dataset_path is not None  # checked by the settings
        specs = sharegpt_requests(settings.dataset_path, maker, rng, count, settings.max_model_len)
    elif settings.dataset == "copy":
        assert settings.dataset_path is not None  # checked by the settings
        specs = copy_requests(
            settings.dataset_path,
            maker,
            rng,
            count,
            settings.copy_input_len,
            settings.copy_output_len,
            settings.max_model_len,
        )
    elif settings.dataset == "prefix":
        specs = prefix_requests(
            maker,
            rng,
            count,
            settings.prefix_num_groups,
            settings.prefix_len,
            settings.suffix_len,
            settings.prefix_output_len,
        )
    elif settings.long_fraction is not None:
        # Warm-ups and measured requests each hold the fraction.
        specs = mixed_requests(maker, rng, settings, settings.num_warmups)
        specs += mixed_requests(maker, rng, settings, settings.num_prompts)
    else:
        specs = random_requests(
            maker, rng, count, *random_lengths, settings.random_range_ratio, request_class="short"
        )
        background = functools.partial(
            long_request,
            maker,
            settings.seed,
            settings.long_input_len,
            settings.long_range_ratio,
            settings.long_output_len,
        )
    warmups = settings.num_warmups
    return Workload(tuple(specs[warmups:]), tuple(specs[:warmups]), background)
