"""The gateway: the OpenAI-compatible HTTP API (completions, chat, files and batches), the
routing of each request to a prefill and a decode worker over gRPC, and the worker pool it
learns from Redis. It imports no torch; `server.py` is what `nori serve gateway` runs.

One /v1/completions request, in the order it passes the files (control only points down):

- `middleware.py`, `metrics.py`: API key, body bound, request and trace ids, request counts;
- `app.py`: the route; `protocol.py`: the body's type;
- `endpoints.py`: prompts and sampling parameters (`prompts.py`), one backend request per
  choice, then `respond`: the backend streams (`streams.py`), answered in the API's format
  (`formats.py`);
- `cluster.py`: the request's one ticket (`ticket.py`) in the gateway's `ledger.py`: admission,
  fair shares of the pools, what each worker holds;
- `request_flow.py`: route, reserve, prefill, stream, migrate, over gRPC (`worker_calls.py`,
  with the retry policy) to the workers of `worker_pool.py`;
- `errors.py`: every error and the OpenAI answer it becomes; `backend.py`: the interface between
  the OpenAI side and the cluster.
"""
