"""Errors raised while reading model folders."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder, its config or its weights cannot be used; the message says which file and why."""
