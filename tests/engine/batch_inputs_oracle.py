"""The step-input builder the engine used before `StepInputs`, kept as its test oracle: plain
Python lists turned into fresh tensors every step, block tables padded to the step's longest."""

from __future__ import annotations

import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.scheduler import SchedulerOutput
from nori.engine.step_inputs import BatchInputs
from nori.engine.step_sampling import PromptLogprobRows, rows_to_score


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
            rows = rows_to_score(request, start, end, query_start_loc[-2])
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
