"""The gateway: the OpenAI-compatible HTTP API (completions, chat, files and batches), the
routing of each request to a prefill and a decode worker over gRPC, and the worker pool it
learns from Redis. It imports no torch; `server.py` is what `nori serve gateway` runs.

A request passes middleware.py, app.py, endpoints.py (respond, streams.py, formats.py),
cluster.py (its ticket in ledger.py, the retries), request_flow.py (worker_pool.py): control
only points down. docs/architecture.md, "One request, file by file", walks it.
"""
