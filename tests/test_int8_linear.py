"""Int8 weight-only linear layers (draft heads only): quantization bounds, the kernel path against
the dequantized reference, the fallback where the kernel is not used, in-place replacement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfspec.kernels.int8_linear import KERNEL_BLOCK, Int8Linear, quantize_linears, quantize_rows


def _linear(n, k, bias=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.1, 3.0, n)[:, None])  # rows of very different scales
    return lin.to(dtype)


def test_rows_are_quantized_symmetrically_within_half_a_step():
    w = _linear(48, 64).weight.detach()
    w[5] = 0.0  # a row of zeros decodes to zeros
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and scale.shape == (48,)
    assert torch.equal(q[5], torch.zeros(64, dtype=torch.int8))
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    assert torch.equal(q.abs().amax(1)[torch.arange(48) != 5], torch.full((47,), 127, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("k", [KERNEL_BLOCK * 3, 70])
def test_output_is_the_dequantized_product(dtype, k):
    lin = _linear(96, k, bias=True, dtype=dtype)
    q = Int8Linear.from_linear(lin)
    assert q.kernel is False or k % KERNEL_BLOCK == 0  # never the kernel on sizes it mishandles
    x = torch.randn(2, 5, k, dtype=dtype)
    y = q(x)
    assert y.shape == (2, 5, 96) and y.dtype == dtype
    ref = x.double() @ q.dequantized(torch.float64).T + lin.bias.double()
    if q.kernel:  # 16-bit activations inside the kernel
        assert (y.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    else:
        torch.testing.assert_close(y, (ref if dtype == torch.float64 else ref.to(dtype)), rtol=2e-2, atol=2e-2)
    # and close to the float layer it came from (weights within half a quantization step)
    assert (y.double() - lin(x).double()).abs().max() <= 0.05 * lin(x).double().abs().max()


def test_fallback_equals_a_plain_linear_on_the_dequantized_weight():
    lin = _linear(40, 70, dtype=torch.float64)
    q = Int8Linear.from_linear(lin)
    assert not q.kernel  # 70 is not a multiple of the kernel's block
    x = torch.randn(3, 70, dtype=torch.float64)
    assert torch.equal(q(x), torch.nn.functional.linear(x, q.dequantized(torch.float64)))


def test_quantize_linears_replaces_in_place_and_honours_exclusions():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64)))
    count = quantize_linears(model, exclude=("2.1",))
    assert count == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    assert type(model[2][1]) is nn.Linear
    assert model(torch.randn(4, 64)).shape == (4, 64)
