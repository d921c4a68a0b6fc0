"""Where an EAGLE-3 step's time goes on this machine: tap capture in the verify pass, and the draft
step split into the draft layer, the draft LM head and the rest (tree building, Python).

    python scripts/profile_draft.py checkpoints/smollm2-135m-instruct-eagle3 [--dtype float32] --out docs/results/eagle3_costs

* verify: one target pass over n tree nodes after a 256-token context, without taps, with the taps
  recorded by forward pre-hooks (what selfspec does) and with ``output_hidden_states=True``;
* draft: median seconds of ``propose`` for the checkpoint's tree, and of its parts measured alone:
  the draft layer over one level's nodes, the norm + LM head + log-softmax + top-k of one level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.measurement.calibration import median_seconds  # noqa: E402
from selfspec.drafters.base import DraftContext  # noqa: E402
from selfspec.kv_cache import new_cache  # noqa: E402
from selfspec.lm_head import lm_logits  # noqa: E402
from selfspec.sampling import SamplingConfig  # noqa: E402
from selfspec.taps import capture_taps  # noqa: E402


def verify_costs(model, taps, sizes, context=256, repeats=7) -> dict:
    decoder = model.get_decoder()
    vocab = model.config.get_text_config(decoder=True).vocab_size
    out = {}
    for n in sizes:
        ids = torch.arange(context + n)[None] % vocab
        cache = new_cache()
        decoder(input_ids=ids[:, :context], cache=cache)
        new = ids[:, context:]

        def plain():
            lm_logits(model, decoder(input_ids=new, cache=cache).last_hidden_state[0])

        def hooked():
            with capture_taps(model, taps) as rec:
                lm_logits(model, decoder(input_ids=new, cache=cache).last_hidden_state[0])
            rec.get()

        def hidden_states():
            o = decoder(input_ids=new, cache=cache, output_hidden_states=True)
            lm_logits(model, o.last_hidden_state[0])
            torch.cat([o.hidden_states[k] for k in taps], -1)

        crop = lambda: cache.crop(-n)  # noqa: E731
        out[n] = {name: median_seconds(f, repeats, crop) for name, f in
                  (("no_taps", plain), ("hooks", hooked), ("output_hidden_states", hidden_states))}
    return out


@torch.no_grad()
def draft_costs(model, drafter, tokenizer, repeats=15) -> dict:
    from selfspec.chat import encode_chat
    from selfspec.target import TreeTarget

    ids = encode_chat(tokenizer, "Explain how a hash map works, with an example in Python.")[0]
    target = TreeTarget(model, taps=drafter.taps)
    feats = target.prefill(ids).taps
    drafter.reset()
    drafter.catch_up(ids, feats)
    ctx = DraftContext(ids, None, 16, SamplingConfig(0.0), torch.Generator())
    propose = median_seconds(lambda: drafter.propose(ctx), repeats)
    head, cfg = drafter.head, drafter.cfg
    dev, dtype = drafter._device_dtype()
    h = head.cfg.hidden_size
    w = cfg.width
    emb, feat = torch.randn(w, h, dtype=dtype), torch.randn(w, h, dtype=dtype)
    pos = torch.full((w,), drafter.cached, dtype=torch.long)
    visible = torch.ones(w, drafter.cached + w, dtype=torch.bool)
    layer = median_seconds(lambda: head.step(emb, feat, pos, drafter.k, drafter.v, visible), repeats)
    lm = median_seconds(lambda: head.logits(feat).float().log_softmax(-1).topk(cfg.branch, dim=-1), repeats)
    levels = cfg.max_depth
    return {"tree": {k: getattr(cfg, k) for k in ("max_depth", "width", "branch", "max_nodes")},
            "propose_s": propose, "layer_call_s": layer, "head_call_s": lm, "levels": levels,
            "overhead_s": max(0.0, propose - levels * (layer + lm)),
            "draft_vocab_size": int(head.d2t.shape[0])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None, help="output prefix (.json)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = selfspec.load_target(args.target, dtype=args.dtype)
    drafter = selfspec.load_drafter(args.checkpoint, model)
    result = {"dtype": args.dtype, "verify": verify_costs(model, list(drafter.taps), [1, 4, 8, 16]),
              "draft": draft_costs(model, drafter, tok)}
    for n, row in result["verify"].items():
        print(f"verify {n:2d} nodes: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row.items()))
    d = result["draft"]
    print(f"draft step ({d['tree']}): propose {d['propose_s'] * 1e3:.1f} ms = {d['levels']} levels x "
          f"(layer {d['layer_call_s'] * 1e3:.2f} + head {d['head_call_s'] * 1e3:.2f} ms) + overhead "
          f"{d['overhead_s'] * 1e3:.1f} ms")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
