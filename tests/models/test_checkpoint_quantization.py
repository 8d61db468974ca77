"""FP8 checkpoints in the compressed-tensors format load as they are; other formats are refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nori.models.errors import ModelLoadError
from nori.models.init_checkpoint import init_checkpoint
from nori.models.loader import load_model
from nori.models.quantization import WeightOnlyLinear
from tests.models.dense_attention import SingleSequenceCausalAttention
from tests.models.model_helpers import sample_ids

_PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def _fp8(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What llm-compressor writes: e4m3 values and a float32 scale per tensor or per row."""
    # Scales shaped [1] per tensor, [out, 1] per channel, as that format stores them.
    amax = weight.abs().amax().reshape(1) if strategy == "tensor" else weight.abs().amax(1, True)
    scale = (amax.float() / 448.0).clamp(min=1e-12)
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale


def _write_fp8_checkpoint(source: Path, folder: Path, strategy: str) -> dict[str, torch.Tensor]:
    """Copies `source` with its projections in fp8; returns the dequantized weights by name."""
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    dequantized: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if _PROJECTION.search(n)]:
        qweight, scale = _fp8(tensors[name], strategy)
        tensors[name] = qweight
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
        tensors[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
        dequantized[name] = qweight.float() * scale
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": False},
            }
        },
        "ignore": ["lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_an_fp8_compressed_tensors_checkpoint_keeps_its_own_weights(
    tmp_path: Path, strategy: str
) -> None:
    source = init_checkpoint(tmp_path / "tiny", "tiny")
    folder = tmp_path / "fp8"
    dequantized = _write_fp8_checkpoint(source, folder, strategy)
    model, config = load_model(folder, torch.float32, "cpu")

    stored = load_file(str(folder / "model.safetensors"))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, WeightOnlyLinear)
    q = config.q_size
    # Bit for bit: the checkpoint's fp8 codes, and each part's own scale over its rows.
    assert torch.equal(
        attn.qkv_proj.qweight[:q].view(torch.uint8),
        stored["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8),
    )
    k_scale = stored["model.layers.0.self_attn.k_proj.weight_scale"].reshape(-1)
    assert torch.equal(attn.qkv_proj.scale[q : q + config.kv_size], k_scale.expand(config.kv_size))

    # The same model with the dequantized weights written in float32 gives the same logits.
    full = load_file(str(source / "model.safetensors"))
    full.update(dequantized)
    plain = tmp_path / "dequantized"
    plain.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (plain / item.name).write_bytes(item.read_bytes())
    save_file(full, str(plain / "model.safetensors"))
    reference, _ = load_model(plain, torch.float32, "cpu")
    ids = sample_ids(config.vocab_size, 20)
    with torch.inference_mode():
        want = reference(ids, torch.arange(20), SingleSequenceCausalAttention())
        have = model(ids, torch.arange(20), SingleSequenceCausalAttention())
    torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)


def test_quantizing_an_already_quantized_checkpoint_is_refused(tmp_path: Path) -> None:
    source = init_checkpoint(tmp_path / "tiny", "tiny")
    _write_fp8_checkpoint(source, tmp_path / "fp8", "channel")
    with pytest.raises(ModelLoadError, match=r"already quantized .*drop --quantization"):
        load_model(tmp_path / "fp8", torch.float32, "cpu", quantization="int8")


@pytest.mark.parametrize(
    ("quantization_config", "what"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            "quant_method 'fp8'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
                },
            },
            "4-bit int weights, strategy 'group'",
        ),
    ],
)
def test_other_quantized_formats_get_a_clear_error(
    tmp_path: Path, quantization_config: dict[str, object], what: str
) -> None:
    folder = init_checkpoint(tmp_path / "tiny", "tiny")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape(what) + ".*compressed-tensors format"):
        load_model(folder, torch.float32, "cpu")
