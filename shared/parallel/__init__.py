"""Tensor parallelism's building blocks: a rank's view of the group and its collectives (gloo on
CPU, NCCL on GPU), and the parallel layers a model cut by nori.models.shard swaps in."""
