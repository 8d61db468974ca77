"""One step's model inputs, written into persistent buffers of fixed address (they only grow,
then at a new address): a host buffer each (pinned on CUDA) and off CPU a device twin, each used
prefix sent in one non-blocking copy. A request's block-table row lives in a store, written when
it gains blocks, rewritten when its list was replaced (on a free or a trim); a step gathers its
rows into a fixed-stride table, zero past each request's blocks. `build` rewrites the host
buffers only once the device has taken the last step's copies. A decode row whose last token is
pending (the step before is in flight) takes its input id on the device from that step's sampled
tokens. Equal to the oracle in tests/engine/batch_inputs_oracle.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nori.engine.attention_metadata import AttentionMetadata
from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import ScheduledRequest, SchedulerOutput
from nori.engine.step_sampling import PromptLogprobRows, SampledStep, rows_to_score


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


class _Buffer:
    """A host tensor (pinned on CUDA) and its device twin (the same tensor on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        self.array = self.host.numpy()
        self.twin = (
            self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        )

    def send(self, count: int) -> torch.Tensor:
        """The first `count` rows on the device, in one non-blocking copy."""
        if self.twin is not self.host:
            self.twin[:count].copy_(self.host[:count], non_blocking=True)
        return self.twin[:count]

    def send_rows(self, start: int, stop: int) -> None:
        """Rows [start, stop) to the device, in one non-blocking copy."""
        if self.twin is not self.host:
            self.twin[start:stop].copy_(self.host[start:stop], non_blocking=True)


@dataclass
class _TableRow:
    request: Request
    index: int  # row of the store
    block_ids: list[int]  # the table written (the request's list: replaced when it is freed)
    num_written: int


class StepInputs:
    def __init__(
        self, max_num_seqs: int, max_num_tokens: int, max_blocks: int, device: torch.device
    ) -> None:
        self.device = device
        self._max_seqs = max_num_seqs
        self._max_tokens = max_num_tokens
        self._max_blocks = max_blocks
        self._allocate()
        self._captured = False  # set once a CUDA graph reads the buffers: they must stay put
        # Recorded after a step's copies to the device (CUDA): the host buffers are free again.
        self._sent: torch.cuda.Event | None = None
        self._rows: dict[str, _TableRow] = {}
        self._free_rows = list(range(2 * max_num_seqs))

    def _allocate(self) -> None:
        seqs, tokens, device = self._max_seqs, self._max_tokens, self.device
        self._input_ids = _Buffer((tokens,), torch.int64, device)
        self._positions = _Buffer((tokens,), torch.int64, device)
        self._slots = _Buffer((tokens,), torch.int64, device)
        self._logits_indices = _Buffer((tokens,), torch.int64, device)
        self._seq_lens = _Buffer((seqs,), torch.int32, device)
        self._query_start = _Buffer((seqs + 1,), torch.int32, device)
        self._tables = _Buffer((seqs, self._max_blocks), torch.int32, device)
        self._gather_to = _Buffer((seqs,), torch.int64, device)
        self._gather_from = _Buffer((seqs,), torch.int64, device)
        self._store = np.zeros((2 * seqs, self._max_blocks), dtype=np.int32)

    def _grow(self, num_seqs: int, num_tokens: int, num_blocks: int) -> None:
        """Larger buffers (new addresses); the store keeps its rows."""
        if self._captured:
            raise RuntimeError("a step outgrew the input buffers that CUDA graphs read")
        store = self._store
        self._max_seqs = max(self._max_seqs, num_seqs)
        self._max_tokens = max(self._max_tokens, num_tokens)
        self._max_blocks = max(self._max_blocks, num_blocks)
        self._allocate()
        self._store[: store.shape[0], : store.shape[1]] = store
        self._free_rows.extend(range(store.shape[0], self._store.shape[0]))

    def build(
        self, output: SchedulerOutput, block_size: int, previous: SampledStep | None = None
    ) -> BatchInputs:
        """`previous`: the step before, when its sampled tokens are still pending."""
        if self._sent is not None:
            self._sent.synchronize()
        scheduled = output.scheduled
        num_seqs = len(scheduled)
        num_tokens = output.num_batched_tokens
        num_blocks = max(len(item.request.block_ids) for item in scheduled)
        if (
            num_seqs > self._max_seqs
            or num_tokens > self._max_tokens
            or num_blocks > self._max_blocks
        ):
            self._grow(num_seqs, num_tokens, num_blocks)
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        logits: list[int] = []
        store_rows: list[int] = []
        prompt_logprob_rows: list[PromptLogprobRows] = []
        num_decodes = num_verifies = 0
        table_row = self._table_row
        gather_to: list[int] = []
        for item in scheduled:
            request = item.request
            store_rows.append(table_row(request))
            start = request.num_computed_tokens
            count = item.num_new_tokens
            row = query_start[-1]
            end = start + count
            if count == 1:
                num_decodes += 1
                if start < len(request.token_ids):
                    ids.append(request.token_ids[start])
                else:  # sampled by the step in flight
                    self._gather_from.array[len(gather_to)] = request.pending_row
                    gather_to.append(row)
                    ids.append(0)
                positions.append(start)
            else:
                ids.extend(request.token_ids[start : end - item.num_spec_tokens])
                if item.num_spec_tokens:
                    ids.extend(request.spec_token_ids)
                    num_verifies += 1
                positions.extend(range(start, end))
            seq_lens.append(end)
            query_start.append(row + count)
            if item.samples:
                logits.extend(range(row + count - 1 - item.num_spec_tokens, row + count))
            if request.prompt_logprobs is not None:
                rows = rows_to_score(request, start, end, row)
                if rows is not None:
                    prompt_logprob_rows.append(rows)
        row = query_start[-1]
        self._input_ids.array[:row] = ids
        self._positions.array[:row] = positions
        self._seq_lens.array[:num_seqs] = seq_lens
        self._query_start.array[: num_seqs + 1] = query_start
        self._logits_indices.array[: len(logits)] = logits
        tables = self._tables.array[:num_seqs]
        np.take(self._store, store_rows, axis=0, out=tables)
        token_positions = self._positions.array[:row]
        token_rows = self._token_rows(scheduled)
        block_of = tables[token_rows, token_positions // block_size].astype(np.int64)
        self._slots.array[:row] = block_of * block_size + token_positions % block_size
        metadata = AttentionMetadata(
            slot_mapping=self._slots.send(row),
            num_decodes=num_decodes,
            num_verifies=num_verifies,
            num_verify_end_row=query_start[num_decodes + num_verifies],
            seq_lens=self._seq_lens.send(num_seqs),
            query_start_loc=self._query_start.send(num_seqs + 1),
            block_tables=self._tables.send(num_seqs),
            max_seq_len=max(seq_lens),
        )
        input_ids = self._input_ids.send(row)
        if gather_to:
            assert previous is not None and previous.tokens is not None
            count = len(gather_to)
            self._gather_to.array[:count] = gather_to
            source = previous.tokens.index_select(0, self._gather_from.send(count))
            input_ids.index_copy_(0, self._gather_to.send(count), source)
        self._mark_sent()
        return BatchInputs(
            input_ids=input_ids,
            positions=self._positions.send(row),
            attention=metadata,
            logits_indices=self._logits_indices.send(len(logits)),
            prompt_logprob_rows=prompt_logprob_rows,
        )

    def pad_decodes(self, num_seqs: int, size: int) -> None:
        """Rows [num_seqs, size) of a pure decode step become padding that changes nothing a
        real row reads: token 0 at position 0, slot -1 (not stored), one token of block 0."""
        pad = slice(num_seqs, size)
        self._input_ids.array[pad] = 0
        self._positions.array[pad] = 0
        self._slots.array[pad] = -1
        self._seq_lens.array[pad] = 1
        self._query_start.array[num_seqs + 1 : size + 1] = np.arange(num_seqs + 1, size + 1)
        self._tables.array[pad] = 0
        for buffer in (self._input_ids, self._positions, self._slots, self._seq_lens):
            buffer.send_rows(num_seqs, size)
        self._query_start.send_rows(num_seqs + 1, size + 1)
        self._tables.send_rows(num_seqs, size)
        self._mark_sent()

    def _mark_sent(self) -> None:
        if self.device.type == "cuda":
            self._sent = self._sent or torch.cuda.Event()
            self._sent.record()

    def decode_batch(
        self, size: int, max_seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and metadata of a pure decode step of `size` rows, as views of
        the device buffers at fixed addresses (what a CUDA graph reads); max_seq_len bounds
        every row's context (it sizes the attention splits)."""
        self._captured = self._captured or self.device.type == "cuda"
        metadata = AttentionMetadata(
            slot_mapping=self._slots.twin[:size],
            num_decodes=size,
            seq_lens=self._seq_lens.twin[:size],
            query_start_loc=self._query_start.twin[: size + 1],
            block_tables=self._tables.twin[:size],
            max_seq_len=max_seq_len,
            num_verify_end_row=size,
        )
        return self._input_ids.twin[:size], self._positions.twin[:size], metadata

    @staticmethod
    def _token_rows(scheduled: Sequence[ScheduledRequest]) -> np.ndarray:
        """The sequence of each token row."""
        counts = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, len(scheduled))
        return np.repeat(np.arange(len(scheduled)), counts)

    def _table_row(self, request: Request) -> int:
        """The store row holding `request`'s block table, its new blocks written."""
        entry = self._rows.get(request.request_id)
        if entry is None or entry.request is not request:
            if entry is not None:
                self._release(entry)
            if not self._free_rows:
                self._sweep()
            entry = _TableRow(request, self._free_rows.pop(), request.block_ids, 0)
            self._rows[request.request_id] = entry
        block_ids = request.block_ids
        count = len(block_ids)
        if entry.block_ids is block_ids and count == entry.num_written:
            return entry.index  # a decode inside its last block: nothing to write
        if entry.block_ids is not block_ids:
            entry.block_ids, entry.num_written = block_ids, 0
        row = self._store[entry.index]
        row[entry.num_written : count] = block_ids[entry.num_written :]
        if entry.num_written == 0 and count < row.shape[0]:
            row[count:] = 0
        entry.num_written = count
        return entry.index

    def _release(self, entry: _TableRow) -> None:
        del self._rows[entry.request.request_id]
        self._free_rows.append(entry.index)

    def _sweep(self) -> None:
        """Frees the rows of requests that left the running batch (finished, preempted, held)."""
        for entry in list(self._rows.values()):
            request = entry.request
            if (
                request.status is not RequestStatus.RUNNING
                or request.block_ids is not entry.block_ids
            ):
                self._release(entry)
        if not self._free_rows:
            raise RuntimeError("more running requests than step-input rows")
