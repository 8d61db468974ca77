"""Engine settings, frozen once built; derived values are properties or resolved at start."""

from __future__ import annotations

from dataclasses import dataclass

from nori.settings import DEFAULT_BLOCK_SIZE

# What --kv-cache-dtype takes; the 8-bit names are nori.kernels.kv_quant.KV_CACHE_DTYPES' keys
# (not imported: the config stays free of torch).
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    # "demo" (a small random-weight model created on first use) or a local checkpoint folder.
    model: str = "demo"
    # Whose tokenizer (and chat template) to use, as `model` names a model; None: the model's.
    tokenizer: str | None = None
    # "auto": float32 on CPU, the checkpoint's half type (else bfloat16) on GPU.
    dtype: str = "auto"
    device: str = "auto"
    # Weight-only quantization of the decoder's linear layers: None, "int8" or "fp8".
    quantization: str | None = None
    # With `quantization`, the LM head too (its logits then carry the 8-bit rounding).
    quantize_lm_head: bool = False
    # "auto": the KV cache in the model's dtype; "int8" or "fp8": 8-bit codes with a float16
    # scale per token and kv head (nori.kernels.kv_quant), about half of bf16's bytes.
    kv_cache_dtype: str = "auto"
    # Ranks (processes) one model is split across, Megatron-style (nori.parallel): 1 = none.
    tensor_parallel_size: int = 1
    # "dummy" makes random weights on the device instead of reading safetensors (benchmarks).
    load_format: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    # KV pool size: an explicit block count wins; else a memory budget.
    num_kv_blocks: int | None = None
    # Bytes of KV cache on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE plays this role).
    cpu_kv_cache_gib: float = 1.0
    # Share of the GPU's memory the engine may use, weights and KV cache together.
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Prompt tokens a step may carry while decodes run in it (see SchedulerConfig): a number,
    # "auto" (as many as cost about one decode step, learnt from the steps' timings: see
    # step_cost.py; what serving workers use), or None: no cap beyond max_num_batched_tokens,
    # the offline throughput setting.
    prefill_budget_with_decodes: int | str | None = None
    # Prompt tokens of background requests (a priority above 0: batch lines) a step may carry;
    # None: no cap beyond the step's. Serving workers cap them (SERVING_BACKGROUND_PREFILL_BUDGET)
    # so that an interactive prompt arriving beside a batch waits for a short step, not one of
    # max_num_batched_tokens batch prompt tokens, and shares its own step with few of them.
    background_prefill_budget: int | None = None
    # Longest prompt + output; None means the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # "continuous" or "static" (the baseline `nori bench offline --compare-static` runs).
    scheduling_policy: str = "continuous"
    # Seeds weight init for dummy weights and the sampler of unseeded requests.
    seed: int = 0
    # "auto": Triton kernels on GPU; on CPU the C++ decode kernel where it builds, else the
    # PyTorch references. "triton" forces the Triton kernels (on CPU only under
    # TRITON_INTERPRET=1, for tests), "cpu" the C++ kernel, "reference" the PyTorch attention
    # references (NORI_CPU_KERNELS=0 also turns off the C++ norm, rotary and MLP kernels).
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        budget = self.prefill_budget_with_decodes
        if budget is not None and budget != "auto" and (not isinstance(budget, int) or budget < 1):
            raise ValueError(
                f"prefill_budget_with_decodes must be an int >= 1, 'auto' or None, got {budget!r}"
            )
        background = self.background_prefill_budget
        if background is not None and background < 1:
            raise ValueError(f"background_prefill_budget must be >= 1 or None, got {background}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}"
            )
        if self.quantization not in (None, "int8", "fp8"):
            raise ValueError(f"quantization must be int8 or fp8, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization method (int8 or fp8)")
        if self.attention_backend not in ("auto", "triton", "cpu", "reference"):
            raise ValueError(
                "attention_backend must be auto, triton, cpu or reference, "
                f"got {self.attention_backend!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
