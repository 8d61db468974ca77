"""Sampling and text: request parameters, tokenizer, streaming detokenizer, batched sampler."""

from nori.sampling.batch import RowState, SamplingBatch, make_generator
from nori.sampling.chat_template import ChatTemplateError
from nori.sampling.detokenizer import DetokenizeResult, IncrementalDetokenizer
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams
from nori.sampling.sampler import Sampler, SamplerOutput
from nori.sampling.tokenizer import Tokenizer, TokenizerLoadError

__all__ = [
    "ChatTemplateError",
    "DetokenizeResult",
    "IncrementalDetokenizer",
    "RowState",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "TokenLogprobs",
    "Tokenizer",
    "TokenizerLoadError",
    "make_generator",
]
