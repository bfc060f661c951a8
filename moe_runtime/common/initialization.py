"""Parameter initialization that does not depend on the parameter's dtype or
on the world size: numbers drawn in float64 from a seeded generator."""

from __future__ import annotations

import torch

__all__ = ["uniform"]


def uniform(shape: tuple[int, ...] | torch.Size, bound: float, generator: torch.Generator) -> torch.Tensor:
    """U(-bound, bound) in float64 (nn.Linear's initialization with bound = 1/sqrt(fan_in))."""
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2.0 - 1.0) * bound
