"""Batch jobs: the batch directory, its Redis work queue, the runner role."""
