"""Prepacked linear layers: a CPU target's weights reordered once into the layout oneDNN reads.

Why: on a CPU with AMX / AVX512-BF16, ``nn.Linear`` in bfloat16 reorders the weight into
oneDNN's blocked layout on *every call*, so a decode step pays a copy of every weight matrix. With
the weight reordered once, at load time, a bf16 matmul reads each weight once per call whatever the
number of rows, and a tree of 2-32 tokens costs about what one token costs. On a CPU with AMX
prepacked bf16 is faster than unpacked bf16 and than float32, per matrix and for a whole forward
pass (the measurements behind this choice are in docs/decisions.md). No maintained library does
this for an unmodified transformers model in eager mode (``torch.compile`` freezing does it
inside a compiled graph, at minutes of compile time and recompiles per tree shape), hence this
module.

Invariants:

* :class:`PrepackedLinear` *is* an ``nn.Linear`` holding the same ``weight`` / ``bias``
  Parameters (tied weights stay tied, ``state_dict`` keys and PEFT wrapping are unchanged); only
  its forward differs, and only in inference: with gradients wanted it is ``F.linear``.
* The packed copy is a function of the weight: it is rebuilt when the weight's version counter or
  storage changes (an in-place update, ``load_state_dict``, ``.to``), so it is never stale.
* Memory: the packed copy sits beside the weight (one more copy of the linear weights, 270 MB for
  SmolLM2-135M in bf16); the original stays for training, export and ``state_dict``.
* Each output row depends on its own input row only, as with ``F.linear``: the kernel's result for
  a row is bitwise the same whether it is computed alone or among others (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def prepack_available(dtype: torch.dtype, device="cpu") -> bool:
    """Whether :func:`prepack_linears` can run here: a CPU bf16 model, oneDNN in this torch build,
    and native bf16 matmuls (AVX512-BF16 / AMX; elsewhere bf16 is emulated and packing is moot)."""
    from ..model.machine import bf16_is_fast

    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and bf16_is_fast("cpu"))


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs oneDNN on a once-reordered weight.

    Shapes as ``nn.Linear``: ``[..., in_features]`` -> ``[..., out_features]``. Build it with
    :meth:`wrap`; it shares the wrapped layer's Parameters.
    """

    @classmethod
    def wrap(cls, linear: nn.Linear) -> "PrepackedLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._hooks_from(linear)
        new._packed, new._packed_key = None, None  # packed at the first inference call
        return new

    def __getstate__(self):  # copies and pickles re-pack lazily (the packed tensor is opaque)
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["_packed"], state["_packed_key"] = None, None
        return state

    def _hooks_from(self, linear: nn.Linear) -> None:
        if linear._forward_hooks or linear._forward_pre_hooks or linear._backward_hooks:
            raise ValueError("prepack_linears must run before hooks are registered on the model's linear layers")

    def _pack(self) -> None:
        w = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self._packed_key = (w._version, w.data_ptr(), w.dtype, w.device)

    def _usable(self, x: torch.Tensor) -> bool:
        w = self.weight
        if x.dtype != w.dtype or w.dtype != torch.bfloat16 or w.device.type != "cpu" or x.device.type != "cpu":
            return False
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            return False
        if (w._version, w.data_ptr(), w.dtype, w.device) != self._packed_key:
            self._pack()  # the weight changed since it was packed: never use a stale copy
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._usable(x):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`PrepackedLinear` sharing its
    Parameters; return how many were replaced. Already packed layers are left alone."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear.wrap(child))
                count += 1
    return count
