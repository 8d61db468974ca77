"""Nori prefill worker (arrives with the cluster issue; the engine it runs is nori.engine)."""
