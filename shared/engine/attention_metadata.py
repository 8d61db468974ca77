"""Where one step's tokens sit in the paged KV cache, as tensors the kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    # Cache slot (block_id * block_size + offset) of every new token, [T].
    slot_mapping: torch.Tensor
    # Decode rows (one new token each) come first: rows [0, num_decodes) are decodes.
    num_decodes: int
    # Per sequence, [B]: context length including this step's tokens.
    seq_lens: torch.Tensor
    # [B + 1]: the new tokens of sequence b are query rows query_start_loc[b]:query_start_loc[b+1].
    query_start_loc: torch.Tensor
    # [B, max_blocks], padded with 0 past each sequence's blocks.
    block_tables: torch.Tensor
    # Longest context in the step, on the host: sizes decode's context splits without a sync.
    max_seq_len: int
    # Speculative verification: sequences [num_decodes, num_decodes + num_verifies) each carry
    # a few query rows (the last token and its drafts), causal among themselves over their
    # paged context: a multi-query decode. Prompt chunks follow them.
    num_verifies: int = 0
    # Query rows of the decodes and verifications together (known on the host: where the
    # prompt chunks' rows start without a device sync). 0 when unknown (built by hand).
    num_verify_end_row: int = 0
