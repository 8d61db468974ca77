"""The decode worker: leases KV blocks for incoming prompts, receives them over UCX (or TCP) and
streams tokens back over gRPC; with `--colocated` it computes prompts too. `servicer.py` holds
the `DecodeWorker` that `nori serve decode` runs."""
