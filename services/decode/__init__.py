"""The decode worker: leases KV blocks for incoming prompts, receives them over UCX (or TCP),
and runs paged continuous batching with the engine (nori.engine), streaming tokens back over
gRPC; with `--colocated` it computes prompts too. `servicer.py` holds the `DecodeWorker` that
`nori serve decode` runs."""
