"""`nori bench serve`: a load generator for OpenAI-compatible servers.

The Python API (what `nori bench compare` builds on):

    from nori.bench.serve.settings import ServeBenchSettings
    from nori.bench.serve.runner import run_benchmark_sync  # or `await run_benchmark(...)`
    from nori.bench.serve.plot import plot_runs

    result = run_benchmark_sync(ServeBenchSettings(base_url=..., dataset="mixed"))
    result.to_dict()                                # vLLM-style JSON figures
    plot_runs({"colocated": r1, "disaggregated": r2}, "compare.png")

Nothing is imported here, so that `nori --help` does not pay for aiohttp, numpy or matplotlib.

One module per job: settings (the frozen options), specs/prompts/datasets/sharegpt (what is
sent), arrivals (when), sse/client (one streamed request into a record), records (what was
seen), figures (pure: the latency distributions and throughputs), result/report (JSON and
table), plot, runner (orchestration), args (the command line).
"""
