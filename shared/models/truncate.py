"""A layer-truncated copy of a checkpoint: its first N decoder layers, embeddings, final norm and
LM head, with the same tokenizer: a draft model for self-speculation (as LayerSkip's early exit)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from nori.models.loader import safetensors_files

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def truncate_layers(source: str | Path, target: str | Path, num_layers: int) -> Path:
    """Writes the first `num_layers` layers of the checkpoint at `source` into `target`."""
    source, target = Path(source), Path(target)
    config = json.loads((source / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if (
            path.is_file()
            and path.suffix != ".safetensors"
            and path.name
            not in (
                "config.json",
                "model.safetensors.index.json",
            )
        ):
            shutil.copy2(path, target / path.name)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for path in safetensors_files(source):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 - safe_open has no __iter__
                match = _LAYER.search(name)
                if match is None or int(match.group(1)) < num_layers:
                    kept[name] = weights.get_tensor(name)
    save_file(kept, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
