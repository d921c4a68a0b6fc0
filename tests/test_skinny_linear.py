"""Skinny float32 linear layers (``selfspec.kernels.skinny_linear``): the same function as ``nn.Linear``,
bitwise the same for one row and for training, and speculative greedy decoding on a target that
uses them leaves plain greedy only at rounding near-ties (with a negative control)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import selfspec
from selfspec.drafters import build_drafter
from selfspec.measurement.measure import divergence
from selfspec.kernels.skinny_linear import MAX_ROWS, SkinnyLinear, skinny_available, use_skinny_linears
from tiny_models import tiny_model


def _linear(bias=True, seed=0, out=80, inp=48):
    torch.manual_seed(seed)
    return nn.Linear(inp, out, bias=bias).eval()


@pytest.mark.parametrize("bias", [True, False])
def test_same_function_as_linear_for_every_row_count(bias):
    lin = _linear(bias)
    skinny = SkinnyLinear.wrap(lin)
    assert isinstance(skinny, nn.Linear) and skinny.weight is lin.weight and skinny.bias is lin.bias
    with torch.no_grad():
        for rows in range(1, MAX_ROWS + 4):
            x = torch.randn(1, rows, 48)
            have, want = skinny(x), lin(x)
            assert have.shape == want.shape and have.is_contiguous()
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
            if rows == 1 or rows > MAX_ROWS:  # one row (a plain step) and long inputs: F.linear itself
                assert torch.equal(have, want)
        x64 = torch.randn(3, 48, dtype=torch.float64)  # other dtypes: nn.Linear's own path
        assert torch.equal(skinny.double()(x64), lin.double()(x64))


def test_training_uses_the_plain_linear_and_gradients_flow():
    lin = _linear()
    skinny = SkinnyLinear.wrap(lin)
    x = torch.randn(5, 48, requires_grad=True)
    y = skinny(x)
    assert torch.equal(y, nn.functional.linear(x, lin.weight, lin.bias))
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_wrapped_model_keeps_ties_keys_and_copies():
    model = tiny_model("llama", vocab=64, layers=2, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    keys = list(model.state_dict())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids).logits
    assert use_skinny_linears(model) == 1 + 7 * 2 and use_skinny_linears(model) == 0  # idempotent
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, model(ids).logits)


def _greedy_pair(kind: str, seed: int):
    """A float32 tiny llama with weights of std 0.3 (at the default init its greedy text repeats
    one token whatever the logits' rounding, so no harness could see a wrong product)."""
    model = tiny_model("llama", vocab=64, layers=4, seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    use_skinny_linears(model)
    drafter = (build_drafter(model, "ngram", min_ngram=1) if kind == "ngram"
               else build_drafter(model, "medusa", num_heads=3))
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
    plain = selfspec.generate(model, prompt, max_new_tokens=40, eos_token_id=[])
    return model, drafter, prompt, plain


@pytest.mark.parametrize("kind", ["ngram", "medusa"])
def test_speculative_greedy_with_skinny_linears_leaves_plain_only_at_near_ties(kind):
    """Tree passes of 2-16 rows take the skinny path; every output equals plain greedy's unless
    a float32 near-tie intervenes (the rule of ``test_prepack`` for bf16)."""
    multi_row = 0
    for seed in range(4):
        model, drafter, prompt, plain = _greedy_pair(kind, seed)
        assert len(set(plain.sequences[0, 12:].tolist())) > 5
        spec = selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=40, eos_token_id=[], control=False)
        multi_row += spec.stats.steps < 40
        why = divergence(model, plain.sequences, spec.sequences, prompt.shape[1])
        assert why is None or why.explained, f"seed {seed}: divergence at margin {why.margin} > rounding {why.rounding_gap}"
    assert multi_row, "no step accepted a draft: the skinny path was not exercised"


def test_negative_control_a_skinny_product_that_mixes_rows_is_caught(monkeypatch):
    """The harness above must see a wrong multi-row product: with the rows of every 2-16-row
    product reversed, speculative greedy leaves plain greedy at a position no near-tie explains."""
    inner = SkinnyLinear.forward

    def mixed(self, x):
        y = inner(self, x)
        rows = x.numel() // self.in_features
        if 2 <= rows <= MAX_ROWS and not torch.is_grad_enabled():
            y = y.reshape(rows, -1).flip(0).reshape(y.shape)
        return y

    caught = 0
    for seed in range(4):
        model, drafter, prompt, plain = _greedy_pair("medusa", seed)
        monkeypatch.setattr(SkinnyLinear, "forward", mixed)
        spec = selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=40, eos_token_id=[], control=False)
        monkeypatch.setattr(SkinnyLinear, "forward", inner)
        why = divergence(model, plain.sequences, spec.sequences, prompt.shape[1])
        caught += why is not None and not why.explained
    assert caught


def test_skinny_applies_to_float32_on_cpu_only():
    assert skinny_available(torch.float32, "cpu")
    assert not skinny_available(torch.bfloat16, "cpu") and not skinny_available(torch.float32, "cuda")
    with pytest.raises(ValueError, match="skinny=True needs a float32 model on a CPU"):
        selfspec.load_target("/nonexistent/model", dtype="bfloat16", skinny=True)


def test_skinny_is_the_default_only_where_it_was_measured_faster():
    """AVX2 without AVX-512 (round 24's EPYC): on by default; AVX-512 or AMX (round 28's Xeon,
    where it was measured slower): off unless asked for; never for bf16 or on a GPU."""
    from selfspec.kernels.skinny_linear import skinny_pays

    avx2, avx512, amx = ({"flags": f} for f in (["avx2"], ["avx2", "avx512f"], ["avx2", "avx512f", "amx_bf16"]))
    assert skinny_pays(torch.float32, "cpu", avx2)
    assert not skinny_pays(torch.float32, "cpu", avx512) and not skinny_pays(torch.float32, "cpu", amx)
    assert not skinny_pays(torch.bfloat16, "cpu", avx2) and not skinny_pays(torch.float32, "cuda", avx2)
