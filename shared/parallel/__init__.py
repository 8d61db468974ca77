"""Tensor parallelism's building blocks: one rank's view of the group and its collectives
(torch.distributed: gloo on CPU, NCCL on GPU), and the parallel layers a sharded model swaps in
(cut by nori.models.shard)."""
