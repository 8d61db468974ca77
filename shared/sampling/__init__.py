"""Sampling and text: request parameters, tokenizer, streaming detokenizer, batched sampler.

The modules are imported by name. Only `batch`, `sampler`, `penalties`, `truncation` and
`logprob_math` need torch: the gateway uses the others and must not load it."""
