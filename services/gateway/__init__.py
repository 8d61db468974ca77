"""The gateway: the OpenAI-compatible HTTP API (completions, chat, files and batches), the
routing of each request to a prefill and a decode worker over gRPC, and the worker pool it
learns from Redis. It imports no torch; `server.py` is what `nori serve gateway` runs."""
