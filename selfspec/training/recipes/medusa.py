"""Recipe for Medusa-style heads (``kind: medusa``): K heads guess tokens t+2..t+K+1 from the
target's last hidden state at t; the exported tree is chosen from the measured rank accuracies."""

from __future__ import annotations

from dataclasses import asdict

import torch

from selfspec.training.tree_search import best_tree, expected_accepted_length

from .cached_features import CachedFeatureRecipe, HeadsTrainConfig


class MedusaRecipe(CachedFeatureRecipe):
    name = "medusa heads"
    first = 2

    @property
    def num_outputs(self) -> int:
        return self.cfg.medusa.num_heads

    def options(self) -> dict:
        return asdict(self.cfg.medusa)

    def trainable_of(self, drafter) -> torch.nn.Module:
        return drafter.heads

    def forward(self, heads, h: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` last hidden states -> ``[B, K, V]`` logits of the K heads."""
        return heads.logits(self.model, h)

    def eval_extras(self, acc: list[list[float]]) -> dict:
        tree = best_tree(acc, self.cfg.tree_budget)
        return {"eval/expected_mat_current_tree": expected_accepted_length(self.drafter.template.paths, acc),
                "eval/expected_mat_best_tree": expected_accepted_length(tree.paths, acc)}

    def finalize(self, metrics: dict) -> dict:
        """The exported tree: the best of ``tree_budget`` nodes for the measured accuracies."""
        acc = metrics["eval/rank_accuracy"]
        tree = best_tree(acc, self.cfg.tree_budget).to_list()
        self.drafter.set_tree(tree)
        metrics["eval/expected_mat_current_tree"] = expected_accepted_length(tree, acc)
        return {"tree": tree}


#: what the registry entry of this kind points to (selfspec.drafters.register(..., recipe=...))
RECIPE, CONFIG = MedusaRecipe, HeadsTrainConfig
