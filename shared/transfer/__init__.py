"""Transports that move KV blocks between workers: UCX (ucxx) and a plain TCP fallback."""
