"""Nori: throughput-first LLM serving with disaggregated prefill and decode."""

__version__ = "0.1.0"
