"""GPU check, for a machine with a CUDA device (the CPU CI never runs it).

Two parts, each written to ``--out`` as JSON (and a short Markdown table):

1. **Exactness on CUDA.** A small random llama, float64 on the GPU: speculative greedy output of
   every drafter kind (ngram, suffix, medusa, layerskip with block and LoRA adapters, eagle3 and two unions) must
   be token-identical to transformers' plain greedy on the same device; a sampled run (T=0.8,
   top-p 0.9) must be reproducible from its seed. This is the CPU suite's greedy-identity test,
   run where device placement bugs would show.
2. **Decoding at Llama-3.1-8B's shape** (random bf16 weights): plain tokens/s of selfspec and of
   transformers ``generate``, the verify cost of trees of 1-64 nodes, an EAGLE-3 draft step, and
   speculative tokens/s projected from the shipped SmolLM2 head's calibrated acceptance (a
   projection, labelled as one: a random head accepts nothing).
3. **EAGLE-3 training on the GPU recipe.** ``configs/eagle3/llama3.1-8b.yaml`` with the real
   target's shape (Llama-3.1-8B, from ``selfspec.training.dry_run.KNOWN_TARGETS``) but *random weights*
   (no hub here) in bfloat16, online features, synthetic token data of the recipe's lengths; a few
   optimizer steps after warm-up. Recorded: training tokens/s, peak GPU memory, and the dry run's
   estimate for the same config (memory, and the sustained TFLOP/s the measured speed implies
   against the dry run's assumed 200). Speed does not depend on the weights' values, so random
   weights measure the real cost; the losses mean nothing.

    python scripts/dev/gpu_check.py --out runs/gpu_check           # on a GPU machine
    python scripts/dev/gpu_check.py --out /tmp/g --device cpu --small   # the same code path, tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import selfspec  # noqa: E402
from selfspec.measurement.benchmark import provenance  # noqa: E402


def _tiny_llama(device, vocab=256, layers=6, hidden=128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model.to(device=device, dtype=torch.float64).eval()


def _randomised(drafter, scale=0.3, seed=1):
    """Trained-looking (non-zero) weights for heads that initialise to zero or identity."""
    g = torch.Generator().manual_seed(seed)
    for module in (getattr(drafter, "head", None), getattr(drafter, "heads", None), getattr(drafter, "adapter", None)):
        if module is None:
            continue
        for p in module.parameters():
            if p.dtype.is_floating_point:
                p.data.add_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p) * scale * p.data.std().clamp_min(1e-2))
    return drafter


def exactness(device: str) -> dict:
    from selfspec.drafters import build_drafter

    model = _tiny_llama(device)
    prompt = torch.tensor([[5, 17, 33, 5, 17, 33, 5, 17, 9, 40, 5, 17, 33, 7]], device=device)
    n = 48
    ref = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
    kinds = {
        "ngram": lambda: build_drafter(model, "ngram", min_ngram=1),
        "suffix": lambda: build_drafter(model, "suffix"),
        "medusa": lambda: _randomised(build_drafter(model, "medusa", num_heads=3)),
        "layerskip": lambda: _randomised(build_drafter(model, "layerskip", exit_layer=2)),
        "layerskip (lora)": lambda: build_drafter(model, "layerskip", exit_layer=2, adapter="lora", rank=4),
        "eagle3": lambda: _randomised(build_drafter(model, "eagle3", draft_vocab_size=128)),
        # unions: the controller merges them (control=False below: every step drafts both)
        "eagle3+ngram": lambda: [_randomised(build_drafter(model, "eagle3", draft_vocab_size=128)),
                                 build_drafter(model, "ngram", min_ngram=1)],
        "suffix+ngram": lambda: [build_drafter(model, "suffix"), build_drafter(model, "ngram", min_ngram=1)],
    }
    rows = []
    for name, build in kinds.items():
        def make(build=build):
            torch.manual_seed(0)  # the same drafter each time: a sampled run is reproducible for one drafter
            return build()

        row = {"drafter": name}
        try:
            drafter = make()
            out = selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=n)
            row["greedy_identical"] = bool(torch.equal(out.sequences, ref))
            row["mean_accepted_length"] = round(out.stats.mean_accepted_length, 3)
            a = selfspec.generate(model, prompt, drafter=make(), max_new_tokens=n, temperature=0.8, top_p=0.9, seed=3,
                                  control=False)  # the controller decides by measured time
            b = selfspec.generate(model, prompt, drafter=make(), max_new_tokens=n, temperature=0.8, top_p=0.9, seed=3,
                                  control=False)
            row["sampled_reproducible"] = bool(torch.equal(a.sequences, b.sequences))
            row["sampled_tokens"] = int(a.stats.new_tokens)
        except Exception as exc:  # report every kind, not the first failure only
            row["error"] = f"{type(exc).__name__}: {exc}"
            import traceback

            traceback.print_exc()
        print(row, flush=True)
        rows.append(row)
    return {"device": device, "dtype": "float64", "new_tokens": n, "rows": rows,
            "all_ok": all(r.get("greedy_identical") and r.get("sampled_reproducible") for r in rows)}


def _synthetic_examples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = prompt_len + int(torch.randint(0, prompt_len // 2 + 1, (1,), generator=g))
        r = response_len + int(torch.randint(0, response_len // 2 + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append({"prompt_ids": ids[:p], "response_ids": ids[p:], "source": "synthetic"})
    return out


def _random_target(fields: dict, dtype: str, device: str):
    """A target of the published config ``fields`` with random weights, built on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def _timed_run(recipe_cls, cfg, out_dir: Path, device: str, steps: int, **given):
    """``cfg`` trained for 2 warm-up steps, then ``steps`` timed ones (no export, evaluation or
    checkpoint in between); returns the recipe, the first timed step and the timed seconds."""
    import shutil

    from accelerate.state import AcceleratorState

    shutil.rmtree(out_dir, ignore_errors=True)
    cfg = replace(cfg, target=f"random-weights {cfg.target} shape", export=None, eval_fraction=0.02,
                  optim=replace(cfg.optim, warmup_steps=2, epochs=1.0),
                  run=replace(cfg.run, out_dir=str(out_dir), wandb_mode="disabled", log_every=1,
                              eval_every=10 ** 9, ckpt_every=10 ** 9))
    AcceleratorState._reset_state(reset_partial_state=True)
    recipe = recipe_cls(cfg, **given)
    recipe.setup()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    warm = 2
    recipe.train(stop_at=warm)
    _sync(device)
    started, step0 = time.time(), recipe.step
    recipe.train(stop_at=warm + steps)
    _sync(device)
    return recipe, step0, time.time() - started


def training(device: str, small: bool, steps: int) -> dict:
    from selfspec.training.jobs import load_any
    from selfspec.training.dry_run import KNOWN_TARGETS, estimate
    from selfspec.training.recipes.eagle3 import Eagle3Recipe

    cfg = base = load_any(ROOT / "configs" / "eagle3" / "llama3.1-8b.yaml")
    fields = dict(KNOWN_TARGETS[cfg.target])
    if small:  # the same code path at toy size (a CPU rehearsal of this script)
        fields |= dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096)
        cfg = replace(cfg, tokens_per_batch=2048, max_len=512, eagle3=replace(cfg.eagle3, draft_vocab_size=1024),
                      ttt_steps=3, run=replace(cfg.run, mixed_precision="no"), target_dtype="float32")
    t0 = time.time()
    model = _random_target(fields, cfg.target_dtype, device)
    built = time.time() - t0
    # Lengths like chat distillation: prompts ~200-300 tokens, answers ~400-600.
    scale = 8 if small else 1
    examples = _synthetic_examples(400, 200 // scale, 400 // scale, model.config.vocab_size)
    cfg = replace(cfg, max_eval_examples=8)
    recipe, step0, wall = _timed_run(Eagle3Recipe, cfg, Path("/tmp/selfspec_gpu_check_run"), device, steps,
                                     model=model, examples=examples)
    tokens = sum(len(recipe.train_set[i]["prompt_ids"]) + len(recipe.train_set[i]["response_ids"])
                 for s in range(step0, recipe.step) for i in recipe.step_items(s))
    done = recipe.step - step0
    tps = tokens / wall
    est = {} if small else estimate(base, processes=1, tflops=200.0, tokens=tokens)
    result = {"target_shape": "Llama-3.1-8B" if not small else "toy", "target_params": sum(p.numel() for p in model.parameters()),
              "target_dtype": cfg.target_dtype, "mixed_precision": cfg.run.mixed_precision,
              "trainable_params": sum(p.numel() for p in recipe.trainable.parameters()),
              "ttt_steps": cfg.ttt_steps, "draft_vocab_size": cfg.eagle3.draft_vocab_size,
              "tokens_per_batch": cfg.tokens_per_batch, "model_build_s": round(built, 1),
              "timed_steps": done, "timed_tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tps, 1),
              "last_loss": recipe.history[-1].get("train/loss") if recipe.history else None}
    if device.startswith("cuda"):
        result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 1024 ** 3, 2)
        result["gpu"] = torch.cuda.get_device_name()
    if est:
        result["dry_run_estimate"] = est
        # the dry run's FLOPs per token: 6 x trainable x unrolled steps + 2 x target (its pass)
        flops_per_token = 6 * est["trainable_params"] * cfg.ttt_steps + 2 * est["target_params"]
        result["implied_tflops"] = round(flops_per_token * tps / 1e12, 1)
        result["dry_run_seconds_at_200_tflops"] = round(flops_per_token * tokens / 200e12, 2)
    recipe.cleanup()
    del recipe
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        result["forward_ms_by_new_tokens"] = forward_costs(model, device)
    print(result, flush=True)
    return result


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def forward_costs(model, device: str, context: int = 512, sizes=(1, 4, 8, 16, 32, 64, 128), reps: int = 10) -> dict:
    """One target forward over n new tokens after a ``context``-token KV cache, median ms (what a
    tree of n nodes costs to verify, against n = 1 for a plain decode step)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, model.config.vocab_size, (1, context), generator=g).to(device)
    cache = DynamicCache()
    model(ctx, past_key_values=cache, use_cache=True)
    out = {}
    for n in sizes:
        new = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(device)
        times = []
        for _ in range(reps + 2):
            _sync(device)
            t = time.perf_counter()
            model(new, past_key_values=cache, use_cache=True)
            _sync(device)
            times.append((time.perf_counter() - t) * 1e3)
            cache.crop(-n)
        out[n] = round(sorted(times[2:])[len(times[2:]) // 2], 2)
    print("forward ms by new tokens:", out, flush=True)
    return out


def _chain_mat(rates: list[float], depth: int) -> float:
    """Expected tokens per target pass of a greedy chain of ``depth`` drafts whose level k is accepted
    with probability ``rates[k]`` given the levels before it (plus the bonus / recovered token)."""
    mat, alive = 1.0, 1.0
    for k in range(depth):
        alive *= rates[k] if k < len(rates) else 0.0
        mat += alive
    return mat


def decoding(device: str, small: bool, new_tokens: int = 128) -> dict:
    """Plain decoding (selfspec and transformers ``generate``), the verify cost of trees of 1-64
    nodes, an EAGLE-3 draft step, and speculative tokens/s *projected* from the shipped SmolLM2 head's
    calibrated greedy acceptance per depth (the random head here accepts nothing): Llama-3.1-8B's shape,
    random bf16 weights (speed does not depend on the values)."""
    from selfspec.drafters import build_drafter
    from selfspec.training.dry_run import KNOWN_TARGETS

    fields = dict(KNOWN_TARGETS["meta-llama/Llama-3.1-8B-Instruct"])
    if small:
        fields |= dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096)
    model = _random_target(fields, "float32" if small else "bfloat16", device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 256), generator=torch.Generator().manual_seed(0)).to(device)
    out = {"target_shape": "toy" if small else "Llama-3.1-8B", "dtype": str(next(model.parameters()).dtype)}
    selfspec.generate(model, ids, max_new_tokens=8)  # warm-up
    _sync(device)
    t = time.perf_counter()
    plain = selfspec.generate(model, ids, max_new_tokens=new_tokens)
    _sync(device)
    out["selfspec_plain_tokens_per_s"] = round(plain.stats.new_tokens / (time.perf_counter() - t), 1)
    model.generate(ids, max_new_tokens=8, do_sample=False)
    _sync(device)
    t = time.perf_counter()
    hf = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    out["transformers_tokens_per_s"] = round((hf.shape[1] - ids.shape[1]) / (time.perf_counter() - t), 1)
    costs = forward_costs(model, device, context=256, sizes=(1, 2, 4, 8, 16, 32, 64))
    out["verify_ms"] = costs
    drafter = build_drafter(model, "eagle3", draft_vocab_size=min(32768, vocab))
    drafter.head.to(device=device, dtype=next(model.parameters()).dtype)
    _randomised(drafter)
    spec = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=32, control=False)
    _sync(device)
    spec = selfspec.generate(model, ids, drafter=drafter, max_new_tokens=new_tokens, control=False)
    levels = max(1, len(spec.stats.tested_per_depth))  # the tree's depth: one head call per level
    out["eagle3_draft_ms_per_step"] = round(1e3 * spec.stats.draft_time_s / max(1, spec.stats.steps), 2)
    out["eagle3_draft_ms_per_level"] = round(out["eagle3_draft_ms_per_step"] / levels, 2)
    meta = json.loads((ROOT / "selfspec" / "checkpoints" / "smollm2-135m-instruct-eagle3" / "drafter.json").read_text())
    extra = meta["extra"]
    if extra.get("acceptance"):
        rates, source = [row[0] for row in extra["acceptance"]["greedy"]], "extra.acceptance.greedy (rank 0)"
    else:
        rates, source = extra["eval"]["eval/top1_per_step"], "extra.eval top-1 per step (teacher-forced)"
    projections = {}
    for depth in (1, 2, 3, 4, 5, 6):
        nodes = min((n for n in costs if n >= depth + 1), default=max(costs))
        seconds = (costs[nodes] + depth * out["eagle3_draft_ms_per_level"]) / 1e3
        projections[depth] = round(_chain_mat(rates, depth) / seconds, 1)
    out["projected_speculative_tokens_per_s"] = projections
    out["projection_from"] = f"selfspec/checkpoints/smollm2-135m-instruct-eagle3 {source}, measured on CPU"
    print(out, flush=True)
    return out


def markdown(result: dict) -> str:
    """The result file as Markdown (what ``scripts/render_docs.py`` embeds in the docs)."""
    prov = result.get("provenance", {})
    lines = [f"Command: `{result.get('command', 'python scripts/dev/gpu_check.py --out DIR')}` on {result.get('gpu', result['device'])}, "
             f"torch {prov.get('torch')}, transformers {prov.get('transformers')}, code at {result.get('code_commit', prov.get('commit'))}.", ""]
    ex = result.get("exactness")
    if ex:
        lines += [f"Exactness on `{ex['device']}` ({ex['dtype']}, random 6-layer llama, {ex['new_tokens']} new tokens):", "",
                  "| drafter | greedy identical to `model.generate` | MAT | seeded T=0.8 / top-p 0.9 run reproducible |",
                  "|---|---|---|---|"]
        for r in ex["rows"]:
            lines.append(f"| {r['drafter']} | {r.get('greedy_identical', r.get('error'))} | {r.get('mean_accepted_length', '-')} | "
                         f"{r.get('sampled_reproducible', r.get('error', '-'))} |")
        lines.append("")
    dec = result.get("decoding")
    if dec:
        costs = dec["verify_ms"]
        lines += [f"Decoding at {dec['target_shape']}'s shape (random weights, {dec['dtype']}, 256-token prompt, batch 1):", "",
                  "| measured | value |", "|---|---|",
                  f"| plain decoding, selfspec (tokens/s) | {dec['selfspec_plain_tokens_per_s']} |",
                  f"| plain decoding, transformers `generate` (tokens/s) | {dec['transformers_tokens_per_s']} |",
                  f"| EAGLE-3 draft level (ms) | {dec['eagle3_draft_ms_per_level']} |", "",
                  "| tree nodes | " + " | ".join(str(k) for k in costs) + " |", "|---" * (len(costs) + 1) + "|",
                  "| verify ms | " + " | ".join(str(v) for v in costs.values()) + " |", "",
                  f"Projection (not a measurement): speculative tokens/s of a greedy chain of d drafts, from {dec['projection_from']}:", "",
                  "| d | " + " | ".join(str(k) for k in dec["projected_speculative_tokens_per_s"]) + " |",
                  "|---" * (len(dec["projected_speculative_tokens_per_s"]) + 1) + "|",
                  "| tokens/s | " + " | ".join(str(v) for v in dec["projected_speculative_tokens_per_s"].values()) + " |", ""]
    tr = result.get("training")
    if tr:
        est = tr.get("dry_run_estimate", {})
        mem = est.get("memory_per_process", {})
        lines += [f"EAGLE-3 GPU recipe (`configs/eagle3/llama3.1-8b.yaml`), {tr['target_shape']}-shaped target with random "
                  f"weights in {tr['target_dtype']}, online features, {tr['ttt_steps']} unrolled steps, draft vocabulary "
                  f"{tr['draft_vocab_size']}, {tr['tokens_per_batch']} tokens per batch, 1 process:", "",
                  "| measured | value | dry-run estimate |", "|---|---|---|",
                  f"| training tokens/s | {tr['tokens_per_s']:,.0f} ({tr['timed_steps']} steps, {tr['wall_s']} s) | "
                  f"{tr['timed_tokens'] / max(tr.get('dry_run_seconds_at_200_tflops', 0), 1e-9):,.0f} at the assumed 200 TFLOP/s |",
                  f"| sustained TFLOP/s (dry run's FLOP count) | {tr.get('implied_tflops', '-')} | 200 (assumed) |",
                  f"| peak GPU memory (GiB) | {tr.get('peak_gpu_memory_gib', '-')} | {mem.get('total_gib', '-')} |"]
        costs = tr.get("forward_ms_by_new_tokens")
        if costs:
            lines += ["", "Target forward over n new tokens after a 512-token cache (bf16, transformers eager + sdpa, median ms):", "",
                      "| n | " + " | ".join(str(k) for k in costs) + " |", "|---" * (len(costs) + 1) + "|",
                      "| ms | " + " | ".join(str(v) for v in costs.values()) + " |"]
    md = result.get("medusa_training")
    if md:
        lines += ["", f"Medusa GPU recipe (`configs/medusa/qwen2.5-7b.yaml`, `features: {md['features']}`), "
                  f"{md['target_shape']}-shaped random target in {md['target_dtype']}, {md['heads']} heads, "
                  f"{md['tokens_per_batch']} tokens per batch in {md['grad_accum']} micro-batches, 1 process: "
                  f"{md['positions_per_s']:,.0f} trained positions/s ({md['timed_steps']} steps, {md['wall_s']} s); "
                  f"peak GPU memory {md.get('peak_gpu_memory_gib', '-')} GiB (dry-run estimate "
                  f"{md.get('dry_run_memory_gib', '-')} GiB)."]
    return "\n".join(lines) + "\n"


def medusa_training(device: str, small: bool, steps: int) -> dict:
    """The Medusa GPU recipe (``configs/medusa/qwen2.5-7b.yaml``, online features) on a
    Qwen2.5-7B-shaped random target in bf16, ``optim.grad_accum=4`` (one GPU holds a quarter of
    the 8k-token batch's vocabulary-sized logits at a time); tokens/s and peak memory."""
    from selfspec.training.jobs import load_any
    from selfspec.training.dry_run import KNOWN_TARGETS, estimate
    from selfspec.training.recipes.medusa import MedusaRecipe

    base = load_any(ROOT / "configs" / "medusa" / "qwen2.5-7b.yaml")
    cfg = base = replace(base, optim=replace(base.optim, grad_accum=4))
    fields = dict(KNOWN_TARGETS[base.target])
    if small:
        fields |= dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096)
        cfg = replace(cfg, tokens_per_batch=1024, max_len=512, target_dtype="float32",
                      run=replace(cfg.run, mixed_precision="no", feature_dtype="float32"))
    model = _random_target(fields, cfg.target_dtype, device)
    scale = 8 if small else 1
    examples = _synthetic_examples(300, 200 // scale, 400 // scale, model.config.vocab_size)
    recipe, step0, wall = _timed_run(MedusaRecipe, cfg, Path("/tmp/selfspec_gpu_check_medusa"), device, steps,
                                     model=model, dataset=examples)
    cfg = recipe.cfg
    rows = [r for r in recipe.history if "train/loss" in r]
    from selfspec.training.features import label_counts

    positions = sum(int(label_counts([recipe.examples[i] for i in recipe.step_items(s)], 1, cfg.max_len, 1)[0])
                    for s in range(step0, recipe.step))
    result = {"target_shape": "Qwen2.5-7B" if not small else "toy", "target_dtype": cfg.target_dtype,
              "features": cfg.features, "heads": cfg.medusa.num_heads, "tokens_per_batch": cfg.tokens_per_batch,
              "grad_accum": cfg.optim.grad_accum, "timed_steps": recipe.step - step0, "trained_positions": positions,
              "wall_s": round(wall, 2), "positions_per_s": round(positions / wall, 1),
              "last_loss": rows[-1]["train/loss"] if rows else None}
    if device.startswith("cuda"):
        result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 1024 ** 3, 2)
    if not small:
        est = estimate(base, processes=1, tflops=200.0)
        result["dry_run_memory_gib"] = est["memory_per_process"]["total_gib"]
    recipe.cleanup()
    print(result, flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for gpu_check.json / .md")
    ap.add_argument("--markdown", metavar="JSON", help="only write JSON's Markdown table next to it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy sizes (rehearse the script on CPU)")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps (after 2 warm-up steps)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["exactness", "decoding", "training", "medusa"])
    args = ap.parse_args(argv)
    if args.markdown:
        path = Path(args.markdown)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())), encoding="utf-8")
        return 0
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"provenance": provenance(), "command": "python scripts/dev/gpu_check.py " + " ".join(argv or sys.argv[1:]),
              "torch": torch.__version__,
              "cuda": torch.version.cuda, "device": args.device}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    if "exactness" not in args.skip:
        result["exactness"] = exactness(args.device)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    if "decoding" not in args.skip:
        result["decoding"] = decoding(args.device, args.small)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "training" not in args.skip:
        result["training"] = training(args.device, args.small, args.steps)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    if "medusa" not in args.skip:
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        result["medusa_training"] = medusa_training(args.device, args.small, args.steps)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.md").write_text(markdown(result), encoding="utf-8")
    print(json.dumps(result, indent=1))
    return 0 if result.get("exactness", {}).get("all_ok", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
