"""Model shape and behaviour, parsed from a Hugging Face `config.json`: one `ModelConfig` for
Llama, Mistral, Qwen2, Qwen3 and their MoE relatives Mixtral, Qwen2-MoE and Qwen3-MoE."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nori.models.errors import ModelLoadError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)

_MODEL_TYPES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

MOE_ARCHITECTURES: tuple[str, ...] = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling: long wavelengths are stretched by `factor`, short ones kept."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections (Qwen2 always has it).
    attention_bias: bool = False
    # Bias on o_proj (tied to attention_bias in Llama and Qwen3; never in Qwen2 and Mistral).
    attention_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str | None = None
    # Only None or a window covering every position is accepted (see `from_dict`).
    sliding_window: int | None = None
    # Mixture of experts (0: dense): a routed layer picks the `num_experts_per_tok` experts of
    # highest softmax probability (`norm_topk_prob`: renormalised). Layers in `mlp_only_layers`
    # or off the `decoder_sparse_step` stride keep a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def model_type(self) -> str:
        return _MODEL_TYPES[self.architecture]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether this decoder layer routes its tokens to experts (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def routing_weights_in_float32(self) -> bool:
        """Mixtral weights expert outputs in float32; Qwen MoE models in the activation dtype."""
        return self.architecture == "MixtralForCausalLM"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"no config.json in model folder {Path(path)}")
        try:
            data = json.loads(config_path.read_text())
        except json.JSONDecodeError as error:
            raise ModelLoadError(f"{config_path} is not valid JSON: {error}") from error
        return cls.from_dict(data, source=str(config_path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        architectures = data.get("architectures") or []
        supported = [name for name in architectures if name in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ModelLoadError(
                f"{source}: unsupported architecture {architectures or '(none given)'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = supported[0]
        try:
            return _parse(architecture, data, source)
        except KeyError as error:
            raise ModelLoadError(f"{source}: missing required key {error.args[0]!r}") from error

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` for this model, as transformers 4.x and 5.x both read it."""
        eos: int | list[int] | None = list(self.eos_token_id)
        if isinstance(eos, list) and len(eos) == 1:
            eos = eos[0]
        data: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_dict() if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos or None,
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
        }
        if self.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            data["attention_bias"] = self.attention_bias
        if self.architecture == "LlamaForCausalLM":
            data["mlp_bias"] = self.mlp_bias
        if self.architecture != "LlamaForCausalLM":
            data["sliding_window"] = self.sliding_window
        if self.architecture.startswith("Qwen"):
            data["use_sliding_window"] = False
            data["max_window_layers"] = self.num_hidden_layers
        if self.architecture == "MixtralForCausalLM":
            data["num_local_experts"] = self.num_experts
            data["num_experts_per_tok"] = self.num_experts_per_tok
            data["intermediate_size"] = self.moe_intermediate_size
        elif self.architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            data["num_experts"] = self.num_experts
            data["num_experts_per_tok"] = self.num_experts_per_tok
            data["moe_intermediate_size"] = self.moe_intermediate_size
            data["norm_topk_prob"] = self.norm_topk_prob
            data["decoder_sparse_step"] = self.decoder_sparse_step
            data["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.architecture == "Qwen2MoeForCausalLM":
            data["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
            data["qkv_bias"] = self.attention_bias
        return data


def _parse(architecture: str, data: dict[str, Any], source: str) -> ModelConfig:
    hidden_size = int(data["hidden_size"])
    num_heads = int(data["num_attention_heads"])
    head_dim = int(data.get("head_dim") or hidden_size // num_heads)
    rope_theta, rope_scaling = _parse_rope(data, source)
    max_positions = int(data.get("max_position_embeddings", 2048))
    attention_bias = bool(data.get("attention_bias", False))
    qkv_bias = attention_bias
    output_bias = attention_bias
    if architecture == "Qwen2ForCausalLM":
        # transformers hard-codes Qwen2's q/k/v bias on and its o_proj bias off.
        qkv_bias, output_bias = True, False
    elif architecture == "Qwen2MoeForCausalLM":
        qkv_bias, output_bias = bool(data.get("qkv_bias", True)), False
    elif architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        qkv_bias = output_bias = False
    experts = _parse_experts(architecture, data, source)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(data["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(data["intermediate_size"]),
        num_hidden_layers=int(data["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        attention_output_bias=output_bias,
        mlp_bias=architecture == "LlamaForCausalLM" and bool(data.get("mlp_bias", False)),
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=_parse_eos(data.get("eos_token_id")),
        torch_dtype=data.get("torch_dtype") or data.get("dtype"),
        sliding_window=_parse_sliding_window(architecture, data, max_positions, source),
        **experts,
    )


def _parse_experts(architecture: str, data: dict[str, Any], source: str) -> dict[str, Any]:
    """The expert fields of a mixture-of-experts config (none for a dense one): Mixtral's
    `num_local_experts` and `intermediate_size`, or the Qwen MoE models' `num_experts` (or
    `num_local_experts`), `moe_intermediate_size` and `norm_topk_prob`."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    dense_layers: tuple[int, ...] = ()
    if architecture == "MixtralForCausalLM":
        num_experts = int(data.get("num_local_experts", 8))
        expert_size = int(data["intermediate_size"])
        renormalise, sparse_step = True, 1
    else:
        num_experts = int(data.get("num_experts") or data["num_local_experts"])
        expert_size = int(data["moe_intermediate_size"])
        renormalise = bool(data.get("norm_topk_prob", False))
        sparse_step = int(data.get("decoder_sparse_step", 1))
        dense_layers = tuple(int(index) for index in data.get("mlp_only_layers") or ())
    top_k = int(data.get("num_experts_per_tok", 2))
    if num_experts < 1 or not 1 <= top_k <= num_experts or sparse_step < 1:
        raise ModelLoadError(
            f"{source}: {num_experts} experts with {top_k} per token and decoder_sparse_step "
            f"{sparse_step}: expected 1 <= num_experts_per_tok <= experts, step >= 1"
        )
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = int(data.get("shared_expert_intermediate_size") or 0)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_size,
        "shared_expert_intermediate_size": shared,
        "norm_topk_prob": renormalise,
        "decoder_sparse_step": sparse_step,
        "mlp_only_layers": dense_layers,
    }


def _parse_rope(data: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Reads RoPE settings from transformers 4.x (`rope_theta` and `rope_scaling`, kind under
    "type" or "rope_type") or 5.x (one `rope_parameters` dict)."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    rope_theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return rope_theta, None
    if kind != "llama3":
        raise ModelLoadError(
            f"{source}: unsupported RoPE scaling type {kind!r}; supported: none or 'llama3'"
        )
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get(
                "original_max_position_embeddings", data.get("max_position_embeddings", 8192)
            )
        ),
    )
    return rope_theta, scaling


def _parse_eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(token) for token in value)


def _parse_sliding_window(
    architecture: str, data: dict[str, Any], max_positions: int, source: str
) -> int | None:
    """The window only when it never cuts anything off, else refuses the model (the engine's
    attention has no window)."""
    if architecture.startswith("Qwen"):
        # Qwen configs carry a window but transformers ignores it unless this flag is on.
        if not data.get("use_sliding_window", False):
            return None
    elif architecture not in ("MistralForCausalLM", "MixtralForCausalLM"):
        return None
    # transformers' MistralConfig defaults to a 4096 window when the key is absent.
    window = data.get("sliding_window", 4096)
    if window is None or int(window) >= max_positions:
        return None if window is None else int(window)
    raise ModelLoadError(
        f"{source}: sliding-window attention (window {window} < max_position_embeddings "
        f"{max_positions}) is not supported; only configs with sliding_window null or "
        f">= max_position_embeddings load"
    )
