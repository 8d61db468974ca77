"""Turns a scheduler step into the flat tensors the model and kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.request import Request
from nori.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PromptLogprobRows:
    """Consecutive rows of the flat token axis whose logits score a request's next prompt tokens
    (the row of token i scores token i + 1), for SamplingParams.prompt_logprobs."""

    request: Request
    first_row: int
    # The prompt tokens they score, in order; one per row.
    target_token_ids: list[int]


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    # Rows of the flat token axis whose logits are sampled: a request's last token, or for a
    # verification its last token and each draft (1 + num_spec_tokens consecutive rows).
    logits_indices: torch.Tensor
    # Requests that want prompt logprobs and computed some of their prompt in this step.
    prompt_logprob_rows: list[PromptLogprobRows]


def build_batch_inputs(
    output: SchedulerOutput, block_size: int, device: torch.device
) -> BatchInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    num_decodes = 0
    num_verifies = 0
    max_blocks = max(len(s.request.block_ids) for s in output.scheduled)
    block_rows: list[list[int]] = []
    prompt_logprob_rows: list[PromptLogprobRows] = []

    for item in output.scheduled:
        request = item.request
        start = request.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids.extend(request.token_ids[start:end])
        if item.num_spec_tokens:
            assert len(request.spec_token_ids) == item.num_spec_tokens, "drafts not proposed"
            input_ids.extend(request.spec_token_ids)
            num_verifies += 1
        positions.extend(range(start, end))
        block_ids = request.block_ids
        slots.extend(
            block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)
        )
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
        block_rows.append(block_ids + [0] * (max_blocks - len(block_ids)))
        if item.num_new_tokens == 1:
            num_decodes += 1
        if item.samples:
            first = query_start_loc[-1] - 1 - item.num_spec_tokens
            logits_indices.extend(range(first, query_start_loc[-1]))
        if request.prompt_logprobs is not None:
            rows = _prompt_logprob_rows(request, start, end, query_start_loc[-2])
            if rows is not None:
                prompt_logprob_rows.append(rows)

    def as_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=as_tensor(slots, torch.int64),
        num_decodes=num_decodes,
        num_verifies=num_verifies,
        num_verify_end_row=query_start_loc[num_decodes + num_verifies],
        seq_lens=as_tensor(seq_lens, torch.int32),
        query_start_loc=as_tensor(query_start_loc, torch.int32),
        block_tables=torch.tensor(block_rows, dtype=torch.int32).to(device, non_blocking=True),
        max_seq_len=max(seq_lens),
    )
    return BatchInputs(
        input_ids=as_tensor(input_ids, torch.int64),
        positions=as_tensor(positions, torch.int64),
        attention=metadata,
        logits_indices=as_tensor(logits_indices, torch.int64),
        prompt_logprob_rows=prompt_logprob_rows,
    )


def _prompt_logprob_rows(
    request: Request, start: int, end: int, first_row: int
) -> PromptLogprobRows | None:
    """The rows of tokens [start, end) that score prompt tokens still without a logprob.

    Token index i scores token i + 1; the prompt is tokens [0, P), and the request already holds
    logprobs for its first `done` prompt tokens. A recompute after a preemption therefore adds
    nothing twice.
    """
    assert request.prompt_logprobs is not None
    done = len(request.prompt_logprobs)
    low = max(start, done - 1)
    high = min(end, len(request.prompt_token_ids) - 1)
    if low >= high:
        return None
    return PromptLogprobRows(
        request, first_row + low - start, request.token_ids[low + 1 : high + 1]
    )
