"""Prepacked bf16 linear layers (``selfspec.kernels.prepack``): same function as ``nn.Linear``, never stale,
and speculative greedy decoding on a prepacked target leaves plain greedy only at rounding near-ties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import selfspec
from selfspec.drafters import build_drafter
from selfspec.measurement.measure import divergence
from selfspec.kernels.prepack import PrepackedLinear, prepack_available, prepack_linears
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not prepack_available(torch.bfloat16, "cpu"),
                                reason="needs a CPU with native bf16 matmuls and oneDNN")


def _linear(bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(48, 80, bias=bias).to(torch.bfloat16).eval()


@pytest.mark.parametrize("bias", [True, False])
def test_same_function_as_linear_and_rows_independent(bias):
    lin = _linear(bias)
    packed = PrepackedLinear.wrap(lin)
    assert isinstance(packed, nn.Linear) and packed.weight is lin.weight and packed.bias is lin.bias
    x = torch.randn(2, 16, 48).to(torch.bfloat16)
    with torch.no_grad():
        want, have = lin(x).float(), packed(x).float()
        torch.testing.assert_close(have, want, rtol=2e-2, atol=2e-2)  # bf16 rounding of the accumulations
        flat = x.reshape(-1, 48)
        alone = torch.cat([packed(flat[i: i + 1]) for i in range(flat.shape[0])])
        assert torch.equal(alone, packed(flat)), "a row's result must not depend on the other rows"


def test_the_packed_copy_is_never_stale():
    lin = _linear()
    packed = PrepackedLinear.wrap(lin)
    x = torch.randn(4, 48).to(torch.bfloat16)
    with torch.no_grad():
        before = packed(x)
        packed.weight.mul_(-1.0)  # an in-place update
        torch.testing.assert_close(packed(x).float(), -before.float() + 2 * lin.bias.float(), rtol=2e-2, atol=2e-2)
        packed.load_state_dict({"weight": torch.zeros_like(lin.weight), "bias": lin.bias})
        torch.testing.assert_close(packed(x).float(), lin.bias.float().expand(4, -1), rtol=0, atol=0)


def test_negative_control_without_the_version_check_the_copy_goes_stale(monkeypatch):
    lin = _linear()
    packed = PrepackedLinear.wrap(lin)
    x = torch.randn(4, 48).to(torch.bfloat16)
    with torch.no_grad():
        before = packed(x)
        monkeypatch.setattr(PrepackedLinear, "_pack", lambda self: None)  # never repack
        packed.weight.mul_(-1.0)
        assert torch.equal(packed(x), before), "the harness above must be able to see a stale copy"


def test_training_uses_the_plain_linear_and_gradients_flow():
    lin = _linear()
    packed = PrepackedLinear.wrap(lin)
    x = torch.randn(3, 48).to(torch.bfloat16).requires_grad_(True)
    y = packed(x)
    assert torch.equal(y, nn.functional.linear(x, lin.weight, lin.bias))
    y.float().sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_prepacked_model_keeps_ties_keys_and_copies():
    import copy

    model = tiny_model("llama", vocab=64, layers=2, dtype=torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    keys = list(model.state_dict())
    n = prepack_linears(model)
    assert n == 1 + 7 * 2 and prepack_linears(model) == 0  # idempotent
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        twin = copy.deepcopy(model)  # opaque packed tensors are rebuilt, not copied
        assert torch.equal(twin(ids).logits, model(ids).logits)


@pytest.mark.parametrize("kind", ["ngram", "medusa"])
def test_speculative_greedy_on_a_prepacked_target_leaves_plain_only_at_near_ties(kind):
    """The bf16 near-tie rule of ``test_eagle3`` on prepacked targets, for a lookup and a trained
    kind; and a prepacked run's output equals the unpacked model's wherever no near-tie intervenes."""
    seen = diverged = 0
    for seed in range(4):
        model = tiny_model("llama", vocab=64, layers=4, seed=seed, dtype=torch.bfloat16)
        prepack_linears(model)
        drafter = (build_drafter(model, "ngram", min_ngram=1) if kind == "ngram"
                   else build_drafter(model, "medusa", num_heads=3))
        prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
        plain = selfspec.generate(model, prompt, max_new_tokens=40, eos_token_id=[])
        spec = selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=40, eos_token_id=[], control=False)
        seen += spec.stats.steps < 40 or kind == "medusa"
        why = divergence(model, plain.sequences, spec.sequences, prompt.shape[1])
        if why is not None:
            diverged += 1
            assert why.explained, f"seed {seed}: divergence at margin {why.margin} > rounding {why.rounding_gap}"
    assert seen


def test_prepack_refuses_where_it_cannot_run():
    assert not prepack_available(torch.float32, "cpu")
    with pytest.raises(ValueError, match="prepack=True needs a bfloat16 model"):
        selfspec.load_target("/nonexistent/model", dtype="float32", prepack=True)
