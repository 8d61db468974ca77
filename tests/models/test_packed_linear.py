"""bfloat16 on CPU: layers prepacked for oneDNN give what F.linear gives, and the model loads
with every projection (and the head) packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nori.models.init_checkpoint import init_checkpoint
from nori.models.loader import load_model
from nori.models.packed_linear import PackedBf16Linear, bf16_packing_supported
from tests.models.dense_attention import SingleSequenceCausalAttention
from tests.models.model_helpers import sample_ids

# The packed layer itself needs oneDNN's bf16 GEMM on this CPU (AVX-512 BW/VL/DQ or
# AVX-NE-CONVERT); the model test below runs everywhere and checks what loading chose.
needs_packing = pytest.mark.skipif(
    not bf16_packing_supported(), reason="oneDNN's bf16 GEMM does not run on this CPU"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_is_f_linear_in_bfloat16(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 48, generator=generator).bfloat16()
    bias_values = torch.randn(96, generator=generator).bfloat16() if bias else None
    x = torch.randn(rows, 48, generator=generator).bfloat16()
    layer = PackedBf16Linear(weight, bias_values)
    expected = F.linear(x, weight, bias_values)
    torch.testing.assert_close(layer(x), expected, atol=0, rtol=1.6e-2)
    assert layer(x).dtype is torch.bfloat16


def test_a_bfloat16_model_on_cpu_is_packed_and_keeps_its_logits(tmp_path: Path) -> None:
    """Packed where oneDNN's bf16 GEMM runs; plain bf16 nn.Linear layers elsewhere (an
    AVX2-only host), with the same logits either way."""
    folder = init_checkpoint(tmp_path / "tiny", "tiny")
    model, config = load_model(folder, torch.bfloat16, "cpu")
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, PackedBf16Linear)]
    if bf16_packing_supported():
        # An untied head's own Linear stays (unused: the packed head_module replaces it).
        assert linears == ([] if config.tie_word_embeddings else ["lm_head"])
        assert len(packed) == 4 * config.num_hidden_layers + 1  # the head too
    else:
        assert not packed
        assert len(linears) >= 4 * config.num_hidden_layers
        assert all(
            m.weight.dtype is torch.bfloat16 for m in model.modules() if isinstance(m, nn.Linear)
        )
    reference, _ = load_model(folder, torch.float32, "cpu")
    ids = sample_ids(config.vocab_size, 16)
    with torch.inference_mode():
        have = model.compute_logits(model(ids, torch.arange(16), SingleSequenceCausalAttention()))
        want = reference.compute_logits(
            reference(ids, torch.arange(16), SingleSequenceCausalAttention())
        )
    assert F.cosine_similarity(have, want, dim=-1).min() > 0.999
