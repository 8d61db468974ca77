"""Cluster state in Redis: worker registry, request states, the prefix-block directory."""
