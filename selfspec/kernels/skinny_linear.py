"""Float32 linear layers for a few rows on a CPU: ``(W @ x^T)^T`` instead of ``x @ W^T``.

Why: a verify pass runs the target over a draft tree of 2-17 tokens, so every linear layer is a
matrix product with 2-17 rows. On a CPU without native bf16 the target runs in float32, and there
``nn.Linear`` (MKL's sgemm with the weight as the transposed right operand) handles a few rows
far worse than one, although the weights, which dominate, are read once either way. On a CPU
with AVX2 but no AVX-512, a whole forward pass over a few new tokens is faster with the weight
as the *left* operand, ``W @ x^T`` (a tall-skinny sgemm), than with ``nn.Linear``, and oneDNN with
prepacked float32 weights falls in between (the measurements are in docs/decisions.md). The LM
head already used this layout in :mod:`selfspec.model.lm_head`; this module extends it to the decoder's
layers. No maintained library picks the operand order by row count for an unmodified
transformers model in eager mode, hence this module.

Invariants:

* :class:`SkinnyLinear` *is* an ``nn.Linear`` holding the same ``weight`` / ``bias`` Parameters
  (tied weights stay tied; ``state_dict`` keys, copies and PEFT wrapping are unchanged); only its
  inference forward differs, and only for ``2 <= rows <= max_rows`` float32 rows on a CPU.
* One row (a plain decode step), more than ``max_rows`` rows and any row count with gradients
  wanted run ``F.linear`` itself: decode steps are bitwise what they were (a prefill of 2-16
  tokens takes the skinny path, in plain and speculative decoding alike).
* Each output row is the same function of its own input row as ``F.linear``'s; the float32 result
  may differ from ``F.linear``'s in the last bits (another summation order), as ``F.linear``'s own
  results for a row alone and among others already do. Greedy speculative output therefore equals
  plain greedy unless a near-tie of float32 rounding intervenes (tested with
  :func:`selfspec.measurement.measure.divergence`, as bf16 is).
* The output is contiguous, laid out as ``F.linear``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # above this (prefill, long trees) the row-major product is as fast or faster here


def skinny_available(dtype: torch.dtype, device="cpu") -> bool:
    """Whether :func:`use_skinny_linears` applies: a float32 model on a CPU."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def skinny_pays(dtype: torch.dtype, device="cpu", identity: dict | None = None) -> bool:
    """Whether :func:`selfspec.load_target` wraps by default: where it applies and was measured
    faster, a CPU with AVX2 but no AVX-512. With AVX-512 the row-major product is faster (the
    measurements for both are in docs/decisions.md)."""
    from ..model.machine import cpu_class

    return skinny_available(dtype, device) and cpu_class(identity) == "avx2"


class SkinnyLinear(nn.Linear):
    """An ``nn.Linear`` that computes a few float32 rows as ``(W @ x^T)^T`` in inference.

    Shapes as ``nn.Linear``: ``[..., in_features]`` -> ``[..., out_features]``. Build it with
    :meth:`wrap`; it shares the wrapped layer's Parameters.
    """

    max_rows: int = MAX_ROWS

    @classmethod
    def wrap(cls, linear: nn.Linear, max_rows: int = MAX_ROWS) -> "SkinnyLinear":
        if linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks:
            raise ValueError("use_skinny_linears must run before hooks are registered on the model's linear layers")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.max_rows = max_rows
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(1, self.in_features)
        if (rows < 2 or rows > self.max_rows or x.dtype != torch.float32 or w.dtype != torch.float32
                or x.device.type != "cpu" or w.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        flat = x.reshape(rows, self.in_features)
        out = torch.mm(w.detach(), flat.t()).t()
        if self.bias is not None:
            out = out + self.bias.detach()
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)


def use_skinny_linears(model: nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` in place by a :class:`SkinnyLinear` sharing
    its Parameters; return how many were replaced (already wrapped layers are left alone)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, SkinnyLinear.wrap(child, max_rows))
                count += 1
    return count
