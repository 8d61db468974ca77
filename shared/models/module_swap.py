"""Swapping a loaded model's nn.Linear layers for other modules (8-bit, prepacked weights)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears(
    root: nn.Module,
    make: Callable[[nn.Linear], nn.Module],
    skip: Callable[[str], bool] = lambda name: False,
) -> int:
    """Replaces every nn.Linear under `root` (but those whose attribute name `skip` names) by
    `make(linear)`, in place; returns how many."""
    replaced = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not skip(name):
                setattr(parent, name, make(child))
                replaced += 1
    return replaced
