"""The prefill worker: computes each prompt's KV cache with the engine (nori.engine) and ships
its blocks over UCX (or TCP) into the decode worker that leased them. `worker.py` holds the
`PrefillWorker` that `nori serve prefill` runs."""
