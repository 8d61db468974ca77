"""Tensor parallelism's building blocks: one rank's view of the group and its collectives
(torch.distributed: gloo on CPU, NCCL on GPU), and the parallel layers a sharded model swaps in.
How a model is cut into shards is nori.models.shard; the follower ranks an engine starts are
nori.engine.follower_ranks."""
