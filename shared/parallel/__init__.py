"""Tensor parallelism inside one worker: ranks are processes, torch.distributed carries the
collectives (gloo on CPU, NCCL on GPU), rank 0 schedules and the others follow its steps."""
