from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from nori.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from nori.models.errors import ModelLoadError
from nori.models.presets import PRESETS

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
}
LLAMA3_PARAMS = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def test_defaults() -> None:
    config = ModelConfig.from_dict({**BASE, "eos_token_id": 7})
    assert config.head_dim == 16
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None
    assert config.eos_token_id == (7,)
    assert not config.attention_bias and not config.qk_norm and not config.tie_word_embeddings


def test_eos_list_and_dtype_spellings() -> None:
    config = ModelConfig.from_dict({**BASE, "eos_token_id": [1, 5], "dtype": "bfloat16"})
    assert config.eos_token_id == (1, 5)
    assert config.torch_dtype == "bfloat16"


@pytest.mark.parametrize(
    "rope_keys",
    [
        {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3_PARAMS}},
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3_PARAMS}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3_PARAMS}},
    ],
    ids=["type", "rope_type", "transformers5"],
)
def test_llama3_rope_spellings(rope_keys: dict[str, object]) -> None:
    config = ModelConfig.from_dict({**BASE, **rope_keys})
    assert config.rope_theta == 5e5
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 128)


def test_transformers5_default_rope() -> None:
    data = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    config = ModelConfig.from_dict(data)
    assert (config.rope_theta, config.rope_scaling) == (1e6, None)


def test_unsupported_rope_type() -> None:
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_qwen2_always_has_qkv_bias_and_qwen3_qk_norm() -> None:
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.attention_output_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(ModelLoadError) as error:
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(error.value)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(error.value)


def test_missing_config_names_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path))):
        ModelConfig.from_dir(tmp_path)


def test_missing_key_is_a_model_load_error(tmp_path: Path) -> None:
    data = dict(BASE)
    del data["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelConfig.from_dir(tmp_path)


def test_mistral_sliding_window() -> None:
    mistral = {**BASE, "architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_dict({**mistral, "sliding_window": 256}).sliding_window == 256
    with pytest.raises(ModelLoadError, match="sliding"):
        ModelConfig.from_dict({**mistral, "sliding_window": 64})
    # transformers defaults Mistral's window to 4096 when the key is absent.
    with pytest.raises(ModelLoadError, match="sliding"):
        ModelConfig.from_dict({**mistral, "max_position_embeddings": 8192})


def test_qwen_window_ignored_unless_enabled() -> None:
    qwen = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert ModelConfig.from_dict(qwen).sliding_window is None
    with pytest.raises(ModelLoadError, match="sliding"):
        ModelConfig.from_dict({**qwen, "use_sliding_window": True})


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_hf_dict(name: str) -> None:
    config = PRESETS[name]
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_config_is_frozen() -> None:
    config = PRESETS["tiny"]
    with pytest.raises(AttributeError):
        config.vocab_size = 3  # type: ignore[misc]
    assert replace(config, vocab_size=3).vocab_size == 3
