"""Layer-skip drafter with LoRA adapters (PEFT adapters on weight-sharing copies of the first E layers): the verify
pass is the bare target bit for bit, greedy output is exact on every family, sampled children keep
the target's law, the PEFT adapter folder loads with ``PeftModel.from_pretrained`` and gives the
same draft logits, checkpoints round-trip, and the recipe trains, resumes and exports."""

from __future__ import annotations

import copy

import pytest
import torch

import selfspec
from selfspec.drafters import build_drafter, load_drafter, save_drafter
from selfspec.model.layer_slice import LayerSlice
from selfspec.model.lm_head import lm_logits
from selfspec.decoding.sampling import SamplingConfig
import selfspec.decoding.verify as verify_mod
from test_distribution import _stale_bonus, chi_square_ok, control_samples
from test_layerskip import PROMPT, SAMPLES, _exact_law, _peaked_model, _sampled_counts
from tiny_models import FAMILIES, tiny_model

TREE = dict(width=3, branch=2, max_depth=4)


def _randomised(drafter, scale: float = 0.5, seed: int = 0):
    """Give the (zero-initialised) LoRA B matrices random values, so the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.stack.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return drafter


def _draft_logits(drafter, ids):
    with torch.no_grad():
        return lm_logits(drafter.model, drafter.norm(drafter.body(input_ids=ids)))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_and_an_untouched_target(family):
    model = tiny_model(family, layers=4)
    with torch.no_grad():
        before = model(PROMPT).logits
    names = [n for n, _ in model.named_modules()]
    drafter = _randomised(build_drafter(model, "layerskip", adapter="lora", exit_layer=2, rank=4, **TREE))
    reference = model.generate(PROMPT, max_new_tokens=40, do_sample=False, pad_token_id=0)
    out = selfspec.generate(model, PROMPT, drafter=drafter, max_new_tokens=40)
    assert torch.equal(out.sequences, reference)
    assert out.stats.draft_nodes > 0 and not drafter.requires.target_cache
    with torch.no_grad():
        after = model(PROMPT).logits
    assert torch.equal(before, after)  # the verify pass is the bare target, bit for bit
    assert [n for n, _ in model.named_modules()] == names  # no adapter was injected into it
    plain = build_drafter(model, "layerskip", exit_layer=2, adapter="none", kv_reuse=False)
    assert not torch.allclose(_draft_logits(drafter, PROMPT), _draft_logits(plain, PROMPT))  # adapters matter


def test_untrained_adapters_are_the_plain_early_exit():
    model = tiny_model("llama", layers=4)
    lora = build_drafter(model, "layerskip", adapter="lora", exit_layer=2)
    plain = build_drafter(model, "layerskip", exit_layer=2, adapter="none", kv_reuse=False)
    torch.testing.assert_close(_draft_logits(lora, PROMPT), _draft_logits(plain, PROMPT), rtol=0, atol=0)


@pytest.mark.parametrize("lossy", [False, True])
def test_sampled_children_keep_the_target_law(lossy, monkeypatch):
    """Children drawn without replacement from the LoRA exit's q (T = 0.9, top-k 4): the first
    three tokens follow the target's exact law (chi-square at 1e-6, the layer-skip harness). With a
    stale bonus token (``lossy``) the same harness must fail."""
    if lossy:
        monkeypatch.setattr(verify_mod, "_verify_sampled", _stale_bonus)
    model, cfg = _peaked_model(), SamplingConfig(0.9, top_k=4)
    drafter = _randomised(build_drafter(model, "layerskip", adapter="lora", exit_layer=1, rank=2, width=3,
                                        branch=2, max_depth=2), scale=2.0)
    n = control_samples(SAMPLES) if lossy else SAMPLES
    ok, msg = chi_square_ok(_exact_law(model, cfg), _sampled_counts(model, cfg, drafter, n), n=n)
    assert ok != lossy, msg


def test_peft_folder_loads_with_peft_and_checkpoints_round_trip(tmp_path):
    from peft import PeftModel

    model = tiny_model("llama", layers=4)
    drafter = _randomised(build_drafter(model, "layerskip", adapter="lora", exit_layer=2, rank=4))
    want = _draft_logits(drafter, PROMPT)
    folder = drafter.save_peft(tmp_path / "peft")
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(folder))
    base = peft_model.base_model.model  # the target with PEFT's LoRA layers injected on layers 0..1
    body = LayerSlice(base, [0, 1], final_norm=False)
    with torch.no_grad():
        got = lm_logits(base, base.get_decoder().norm(body(input_ids=PROMPT)))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # selfspec's own checkpoint
    save_drafter(drafter, tmp_path / "ckpt")
    again = load_drafter(tmp_path / "ckpt", model)
    assert again.kind == "layerskip" and again.config.adapter == "lora" and again.config.rank == 4
    torch.testing.assert_close(_draft_logits(again, PROMPT), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot change"):
        drafter.with_options(rank=8)
    assert drafter.with_options(max_depth=2).policy.max_depth == 2


def test_recipe_trains_resumes_and_exports(tmp_path):
    from selfspec.training.config import load_config
    from selfspec.training.recipes import HeadsTrainConfig, LoraSkipRecipe, recipe_for

    model = tiny_model("llama", vocab=64, dtype=torch.float32, layers=4)
    with torch.no_grad():  # peaked laws, and skipped layers that matter: the plain exit is a poor draft
        for layer in model.model.layers[2:]:
            layer.mlp.down_proj.weight.mul_(50)
    g = torch.Generator().manual_seed(0)
    examples = []
    for i in range(12):
        prompt = torch.randint(0, 64, (6,), generator=g)
        out = model.generate(prompt[None], max_new_tokens=20, do_sample=False, pad_token_id=0)[0]
        examples.append(dict(prompt_ids=prompt.tolist(), response_ids=out[6:].tolist()))
    overrides = [f"run.out_dir={tmp_path / 'run'}", "run.wandb_mode=disabled", "run.log_every=2", "run.eval_every=100",
                 "run.ckpt_every=4", "optim.lr=0.02", "optim.warmup_steps=1", "optim.epochs=20", "kind=layerskip",
                 "layerskip.adapter=lora", "layerskip.exit_layer=2", "layerskip.rank=4", "tokens_per_batch=80", "eval_fraction=0.25", f"export={tmp_path / 'exported'}"]
    cfg = load_config(HeadsTrainConfig, None, overrides)
    recipe = recipe_for(cfg, model=model, examples=examples)
    assert isinstance(recipe, LoraSkipRecipe)
    recipe.setup()
    before = recipe.evaluate()["eval/kl"]
    recipe.train(stop_at=6)  # "killed" after the checkpoint at step 4
    resumed = recipe_for(load_config(HeadsTrainConfig, None, overrides), model=model, examples=examples)
    resumed.setup(resume=True)
    assert resumed.step == 4
    resumed.train()
    after = resumed.evaluate()["eval/kl"]
    resumed.export()
    assert after < 0.7 * before, (before, after)
    drafter = load_drafter(tmp_path / "exported", model)
    assert drafter.config.adapter == "lora" and (tmp_path / "exported" / "peft" / "adapter_config.json").exists()
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6]])
    reference = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=16).sequences, reference)
