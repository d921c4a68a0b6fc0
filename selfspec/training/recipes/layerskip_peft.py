"""Recipe for the layer-skip drafter's LoRA adapter (``kind: layerskip``, ``layerskip.adapter:
lora``; config :class:`~selfspec.training.recipes.cached_features.HeadsTrainConfig`): PEFT LoRA adapters on the
target's first E layers, trained so that the early exit (those layers, the final norm, the LM head)
matches the full model's next-token law.

Online, on the shared loop: each batch of whole examples runs the frozen target once under
``torch.no_grad`` (its law ``p``) and the LoRA-adapted first E layers with gradients (``q``); the
loss is ``KL(p || q)`` at every position whose next token the target wrote (the response), each
micro-batch's sum divided by the global batch's count of such positions. Held-out metrics: KL and
top-1 agreement of the exit with the full model (a greedy chain's acceptance, teacher-forced).
Export: the drafter checkpoint, plus the standard PEFT adapter folder in ``<export>/peft``.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

import selfspec
from selfspec.drafters.layerskip import LayerSkipPolicy
from selfspec.model.lm_head import lm_logits

from ..batching import batch_at, collate, length_buckets, load_distilled, split_examples
from ..loop import TrainingRun


class LoraSkipRecipe(TrainingRun):
    """One training run of LoRA adapters on the drafting layers (see the module docstring)."""

    name = "LoRA exit"
    cast_trainable = False  # the stack shares the target's frozen weights: only LoRA tensors train

    def __init__(self, cfg, *, model=None, tokenizer=None, examples=None):
        super().__init__(cfg, model=model, tokenizer=tokenizer)
        self.examples = examples

    def prepare(self) -> None:
        cfg = self.cfg
        if self.examples is None:
            self.examples = load_distilled(cfg.dataset)
        self.train_set, self.eval_set = split_examples(self.examples, cfg.eval_fraction, cfg.run.seed,
                                                       cfg.max_eval_examples)
        self.batches = length_buckets(self.train_set, cfg.max_len, cfg.tokens_per_batch)
        self.drafter = selfspec.build_drafter(self.model, "layerskip", **asdict(cfg.layerskip))
        for name, p in self.drafter.stack.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
        self.trainable = self.drafter.stack

    def forward(self, stack, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` ids -> ``[B, T, V]`` exit logits through the LoRA-adapted first E layers
        (``stack``'s modules are the drafter body's layers)."""
        h = self.drafter.body(input_ids=ids)
        return lm_logits(self.model, self.drafter.norm(h)).float()

    def steps_per_epoch(self) -> int:
        return len(self.batches)

    def step_items(self, step: int) -> list[int]:
        return batch_at(self.batches, step, self.cfg.run.seed)

    def _valid(self, lengths: torch.Tensor, prompts: torch.Tensor, width: int) -> torch.Tensor:
        t = torch.arange(width)[None]
        return (t >= prompts[:, None] - 1) & (t < lengths[:, None] - 1)  # next token is the target's

    def _kl(self, examples: list[dict], run, count: int | None = None):
        """KL sum over ``count`` (default: these examples' valid positions), agreement sum, count."""
        ids, lengths, prompts = collate(examples, self.cfg.max_len)
        ids = ids.to(self.acc.device)
        with torch.no_grad():
            logp = self.model(input_ids=ids).logits.float().log_softmax(-1)
        logq = run(ids).log_softmax(-1)
        valid = self._valid(lengths, prompts, ids.shape[1]).to(ids.device)
        per = (logp.exp() * (logp - logq)).sum(-1)
        n = int(valid.sum()) if count is None else count
        with torch.no_grad():
            agree = float(((logq.argmax(-1) == logp.argmax(-1)) & valid).sum())
        return (per * valid).sum() / max(1, n), agree, int(valid.sum())

    def loss(self, items: list[int], batch: list[int]) -> tuple[torch.Tensor, dict]:
        ex = [self.train_set[i] for i in batch]
        count = sum(min(len(e["prompt_ids"]) + len(e["response_ids"]), self.cfg.max_len) - len(e["prompt_ids"])
                    for e in ex)
        mine = [self.train_set[i] for i in items]
        loss, agree, _ = self._kl(mine, self.module, count)
        return loss, {"train/top1": agree / max(1, count),
                      "_tokens": sum(len(e["prompt_ids"]) + len(e["response_ids"]) for e in mine)}

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.trainable.eval()
        kl = agree = n = 0.0
        for s in range(0, len(self.eval_set), 8):
            loss, a, c = self._kl(self.eval_set[s: s + 8], lambda ids: self.forward(self.trainable, ids))
            kl, agree, n = kl + float(loss) * c, agree + a, n + c
        self.trainable.train()
        top1 = agree / max(1, n)
        return {"eval/kl": kl / max(1, n), "eval/top1": top1,
                "eval/expected_mat_chain": sum(top1 ** d for d in range(LayerSkipPolicy().max_depth + 1))}

    def load_weights(self, drafter) -> None:
        from selfspec.drafters.lora import load_lora_state, lora_state

        load_lora_state(self.drafter.stack, lora_state(drafter.stack))

    def export(self) -> dict:
        from pathlib import Path

        from selfspec.drafters import save_drafter

        metrics = self.final_metrics()
        summary = {"steps": self.step, "train_examples": len(self.train_set), "eval_examples": len(self.eval_set),
                   "metrics": metrics}
        self.write_summary(summary)
        if self.cfg.export and self.acc.is_main_process:
            save_drafter(self.drafter, self.cfg.export, tokenizer=self.tokenizer,
                         extra={"training": asdict(self.cfg), "eval": metrics, "steps": self.step})
            self.drafter.save_peft(Path(self.cfg.export) / "peft")
        return summary

    def plot(self) -> None:
        self.plot_curves({"KL": "train/loss"}, {"top-1": "eval/top1"},
                         ("train KL(target || exit)", "loss", "held-out top-1 agreement", "exit vs full model"))
