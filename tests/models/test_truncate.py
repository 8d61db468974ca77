"""`truncate_layers` (`nori model truncate`): the first N layers of a checkpoint, loadable by
transformers, whose weights are the source's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nori.models.init_checkpoint import init_checkpoint
from nori.models.truncate import truncate_layers


def test_the_copy_is_the_first_layers_of_the_source(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source = init_checkpoint(tmp_path / "source", "tiny-qwen3", seed=2)
    target = truncate_layers(source, tmp_path / "draft", 1)
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 1
    full = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    short = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert len(short.model.layers) == 1
    for name, weight in short.state_dict().items():
        torch.testing.assert_close(weight, full.state_dict()[name], rtol=0, atol=0)
    # The same as running the source's first layer and then its norm and head.
    tokens = torch.tensor([[5, 9, 13, 7]])
    with torch.no_grad():
        hidden = full.model(tokens, output_hidden_states=True).hidden_states[1]
        expected = full.lm_head(full.model.norm(hidden))
        torch.testing.assert_close(short(tokens).logits, expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="num_layers"):
        truncate_layers(source, tmp_path / "bad", 3)
