"""The residual block shared by trainable drafters (Medusa heads, the layer-skip exit adapter)."""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W, b zero-initialised (identity at start)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))
