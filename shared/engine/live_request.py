"""What the engine keeps of a request beside the scheduler's `Request`: its text so far (the
incremental detokenizer), its seeded sampler, what has been reported, and the stop checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nori.engine.outputs import RequestOutput, TokenLogprobs
from nori.engine.request import Request, RequestStatus
from nori.sampling.detokenizer import IncrementalDetokenizer


@dataclass
class LiveRequest:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None

    def check_stop(
        self,
        token_id: int,
        eos_token_ids: frozenset[int] | set[int] | list[int],
        max_model_len: int,
    ) -> RequestStatus | None:
        """Feeds the sampled token (already appended to the request) to the detokenizer; the
        finish status when it ends the request, else None."""
        request = self.request
        params = request.sampling_params
        result = self.detokenizer.add_token(token_id)
        self.text += result.new_text
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return self._flush(RequestStatus.FINISHED_STOPPED)
            if not params.ignore_eos and token_id in eos_token_ids:
                return self._flush(RequestStatus.FINISHED_STOPPED)
            if result.stop_string is not None:
                self.stop_reason = result.stop_string
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or request.num_unpadded_tokens >= max_model_len:
            return self._flush(RequestStatus.FINISHED_LENGTH)
        return None

    def _flush(self, status: RequestStatus) -> RequestStatus:
        self.text += self.detokenizer.flush().new_text
        return status

    def output(self) -> RequestOutput:
        """What is new since the last output (the whole text so far, too); marks it reported."""
        request = self.request
        status = request.status
        output_ids = request.output_token_ids
        finished = status.is_finished
        result = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=output_ids,
            text=self.text,
            new_token_ids=output_ids[self.num_emitted_tokens :],
            new_text=self.text[self.num_emitted_chars :],
            finished=finished,
            finish_reason=status.value if finished else None,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            prefilled=status is RequestStatus.PREFILLED,
        )
        self.num_emitted_tokens = len(output_ids)
        self.num_emitted_chars = len(self.text)
        return result
