"""A real byte-level BPE tokenizer for random-weight checkpoints, trained on the built-in corpus.

Its vocabulary is padded with `<|reserved_N|>` entries up to the model's vocab size, so every id
the model can emit decodes; they are plain vocabulary that no merge produces, not special tokens."""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from nori.models.corpus import training_corpus

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
# The trainer numbers special tokens first, in order; generation stops at end of text or turn.
BOS_ID = 0
EOS_IDS: tuple[int, ...] = (1, 5)

# More merges than the corpus supports (~2300 tokens); training stops on its own before this.
_MAX_TRAINED_VOCAB = 8192
_BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + _BYTE_ALPHABET_SIZE

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


def build_tokenizer_json(vocab_size: int) -> str:
    """The serialized `tokenizer.json`; the same string for the same size, in any process."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} < {MIN_VOCAB_SIZE} (specials + 256 bytes)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, _MAX_TRAINED_VOCAB),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    data: dict[str, Any] = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for index in range(vocab_size - len(vocab)):
        vocab[f"<|reserved_{index}|>"] = len(vocab)
    return json.dumps(data, ensure_ascii=False, indent=1)


def tokenizer_config(max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json` for transformers' AutoTokenizer."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(index): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for index, token in enumerate(SPECIAL_TOKENS)
        },
    }
