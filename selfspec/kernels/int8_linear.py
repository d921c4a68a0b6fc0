"""Int8 weight-only linear layers for draft heads (inference only).

Why: a draft step on a CPU reads every weight of the head for one or a few rows, so it is bound
by how many bytes each call reads, not by arithmetic. Storing the head's matrices as int8 with one
float scale per output row halves those bytes against bf16, so the int8 head and MLP matrices,
and a whole draft step, are faster than in bf16 (also than a prepacked bf16 head); the
measurements behind this choice are in docs/decisions.md.

Why by hand: ``torch._weight_int8pack_mm`` (PyTorch's own CPU kernel, the one gpt-fast calls) is
the fast path; torchao 0.18's ``Int8WeightOnlyConfig`` is slower than plain bf16 on the CPU (it
dequantizes the weight at every call), and no other maintained package quantizes an
``nn.Linear`` to that kernel in eager mode.

Invariants:

* Only drafts use this. A draft is a proposal: exact verification makes the output law the
  target's whatever the draft computes, as long as the law a sampled draft records is the one its
  tokens were drawn from, which holds because the drafter draws from the logits it computed.
* ``W ~ W8 * scale[:, None]``: symmetric per output row, ``W8`` in [-127, 127],
  ``scale = max |W[row]| / 127`` (rows of zeros keep scale 1e-12 and decode to zeros).
* The kernel is used only where it was checked: a CPU, inner size a multiple of 64 (the kernel
  returns garbage or crashes on some other sizes, found by a scan), 16-bit or 32-bit float
  inputs, and one call per layer compared at build time with the dequantized reference. Elsewhere
  the layer multiplies by the dequantized weight (same values, plain ``F.linear``).
* float32 inputs are rounded to bf16 for the kernel and the result is returned in float32: the
  kernel's float32 path is several times slower than its bf16 path, on a CPU with native bf16
  and more so on one without (AVX2 only), where the bf16 path still needs no native bf16 (it
  widens the activations, the weights are int8) and beats the float32 weight in its fastest
  layout (``W @ x^T``); the measurements are in docs/decisions.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_BLOCK = 64  # inner sizes the int8 kernel is used for must be multiples of this


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float weight -> (``[N, K]`` int8, ``[N]`` float32 scales), symmetric per row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = (w / scale[:, None]).round().clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Int8Linear(nn.Module):
    """``y = x @ (W8 * scale[:, None]).T + bias``; shapes as ``nn.Linear``
    (``[..., in_features]`` -> ``[..., out_features]``). Build with :meth:`from_linear`."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)  # float32 master copy
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._scales: dict[torch.dtype, torch.Tensor] = {}
        self._dense: dict[torch.dtype, torch.Tensor] = {}
        self.kernel = self._kernel_checked()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, scale = quantize_rows(linear.weight)
        return cls(q, scale, linear.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``[N, K]`` the weight this layer computes with, in ``dtype``."""
        w = self._dense.get(dtype)
        if w is None:
            w = (self.qweight.float() * self.scale[:, None]).to(dtype)
            self._dense[dtype] = w
        return w

    def _kernel_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    def _kernel_checked(self) -> bool:
        if (self.qweight.device.type != "cpu" or self.in_features % KERNEL_BLOCK
                or not hasattr(torch, "_weight_int8pack_mm")):
            return False
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, self.in_features, generator=gen).to(torch.bfloat16)
        try:
            got = self._kernel_call(x).double()
        except RuntimeError:
            return False
        ref = x.double() @ (self.qweight.double() * self.scale.double()[:, None]).T  # (not kept)
        return bool((got - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3)

    def _kernel_call(self, x2d: torch.Tensor) -> torch.Tensor:
        scale = self._scales.get(x2d.dtype)
        if scale is None:
            scale = self._scales[x2d.dtype] = self.scale.to(x2d.dtype)
        return torch._weight_int8pack_mm(x2d.contiguous(), self.qweight, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.kernel and x.device.type == "cpu"):
            return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        y = self._kernel_call(x.reshape(-1, shape[-1]).to(self._kernel_dtype(x.dtype)))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def quantize_linears(module: nn.Module, exclude: tuple[str, ...] = ()) -> int:
    """Replace every ``nn.Linear`` (prepacked ones included) under ``module`` in place by an
    :class:`Int8Linear`, except those whose qualified name is in ``exclude``; return how many.
    Inference only: the module's ``state_dict`` changes (use a copy, keep the original)."""
    count = 0
    for prefix, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear) and full not in exclude:
                setattr(parent, name, Int8Linear.from_linear(child))
                count += 1
    return count
