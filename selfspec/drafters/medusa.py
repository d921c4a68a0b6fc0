"""Medusa-style heads: K small blocks on the target's last hidden state guess tokens t+2..t+K+1.

Notation: ``h`` is the target's last (post-norm) hidden state at the node that predicted the
current root; the target's own LM head on ``h`` gives the root's law. Head k (k = 1..K) maps ``h``
through ``num_layers`` residual blocks ``x + SiLU(W x)`` (W zero-initialised, so an untrained head
starts as a copy of the LM head) and then through the target's frozen LM head (shared, default) or
an own trainable LM head, predicting the token k positions after the root, i.e. depth k of the
draft tree. The heads read the hidden state the verify pass already computed: no extra target pass.

The tree is a static :class:`~selfspec.decoding.tree.TreeTemplate` filled with each head's top-k tokens as
point-mass children, so verification is exact at any temperature. The target itself is never
modified: heads are a separate module saved as a small adapter checkpoint
(:mod:`selfspec.checkpoint`) tied to the target's fingerprint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..model.lm_head import lm_logits
from ..decoding.tree import DraftTree, TreeBuilder, TreeTemplate
from .base import DraftContext, Drafter, Requirements, TargetSignature
from .registry import config_from_options, register
from .residual import ResBlock

# A 10-node tree for CPU targets (verify cost grows quickly with nodes there); replaced by the one
# chosen from measured head accuracies when a trained checkpoint is loaded.
DEFAULT_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0], [0, 0, 1]]


@dataclass
class MedusaConfig:
    """Shape of the heads.

    Attributes:
        num_heads: K, the deepest draft depth.
        num_layers: residual blocks per head.
        own_lm_head: give each head its own trainable LM head (initialised from the target's)
            instead of sharing the frozen one; K x vocab x hidden more parameters.
        tree: Medusa-style top-k index paths of the draft tree (default: :data:`DEFAULT_TREE` cut
            to ``num_heads`` levels).
    """

    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    tree: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"num_heads and num_layers must be >= 1, got {self.num_heads}, {self.num_layers}")
        if self.tree is None:
            self.tree = [list(p) for p in DEFAULT_TREE if len(p) <= self.num_heads]
        depth = max((len(p) for p in self.tree), default=0)
        if depth > self.num_heads:
            raise ValueError(f"tree depth {depth} exceeds num_heads {self.num_heads}")


class MedusaHeads(nn.Module):
    """K heads; parameters live under ``blocks.*`` (and ``lm_heads.*`` with own LM heads)."""

    def __init__(self, cfg: MedusaConfig, hidden_size: int, lm_head: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(cfg.num_layers)]) for _ in range(cfg.num_heads)
        )
        self.lm_heads = None
        if cfg.own_lm_head:
            if lm_head is None:
                raise ValueError("own_lm_head needs the target's LM head to initialise from")
            self.lm_heads = nn.ModuleList(_copy_linear(lm_head) for _ in range(cfg.num_heads))

    def hidden(self, h: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """``[..., H]`` -> ``[..., num, H]`` features of the first ``num`` heads (default all K)."""
        return torch.stack([block(h) for block in self.blocks[:num]], dim=-2)

    def logits(self, model, h: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """``[..., H]`` -> ``[..., num, V]`` logits of the first ``num`` heads (default all K)."""
        feats = self.hidden(h, num)
        if self.lm_heads is None:
            return lm_logits(model, feats)
        heads = list(self.lm_heads)[: feats.shape[-2]]
        return torch.stack([lm_logits(model, feats[..., k, :], head) for k, head in enumerate(heads)], dim=-2)


def _copy_linear(layer: nn.Module) -> nn.Linear:
    weight = layer.weight.detach()
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=getattr(layer, "bias", None) is not None)
    out.weight.data.copy_(weight)
    if out.bias is not None:
        out.bias.data.copy_(layer.bias.detach())
    return out


class MedusaDrafter(Drafter):
    """Fills a static tree with the heads' top-k tokens (point-mass children)."""

    kind = "medusa"
    requires = Requirements(hidden=True)

    def __init__(self, model, heads: MedusaHeads, signature: TargetSignature | None = None):
        super().__init__(signature or TargetSignature.of(model), model)
        self.heads = heads.eval()
        self.config = heads.cfg
        self.template = TreeTemplate(heads.cfg.tree)

    def set_tree(self, paths: list[list[int]]) -> None:
        """Use another static tree (e.g. one chosen by measured accuracies or calibration)."""
        template = TreeTemplate(paths)
        if template.depth > self.heads.cfg.num_heads:
            raise ValueError(f"tree depth {template.depth} exceeds the {self.heads.cfg.num_heads} heads")
        self.template = template
        self.heads.cfg.tree = template.to_list()

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        if ctx.root_hidden is None or ctx.max_depth < 1:
            return TreeBuilder(ctx.root_token).build()
        depth = min(self.template.depth, ctx.max_depth)
        # All K heads in one matmul: on CPU a [K, H] x [H, V] product with K = 4 beat K = 3 (odd
        # row counts can fall off the fast GEMM path), and the head compute is shared anyway.
        logits = self.heads.logits(self.model, ctx.root_hidden.to(self._dtype()))[:depth]  # [D, V]
        candidates = logits.topk(self.template.max_rank, dim=-1).indices  # [D, k]
        template = self.template if depth == self.template.depth else self._shallow(depth)
        return template.fill(ctx.root_token, candidates)

    @classmethod
    @torch.no_grad()
    def propose_many(cls, drafters: list["MedusaDrafter"], ctxs: list[DraftContext]) -> list[DraftTree]:
        """Every row's tree from one call of the heads over the rows' hidden states (forks of one
        drafter; forks of other heads are drafted alone)."""
        live = [b for b, c in enumerate(ctxs) if c.root_hidden is not None and c.max_depth >= 1]
        if len({id(d.heads) for d in drafters}) > 1 or len(live) < 2:
            return [d.propose(c) for d, c in zip(drafters, ctxs)]
        first = drafters[0]
        hidden = torch.stack([ctxs[b].root_hidden.reshape(-1) for b in live]).to(first._dtype())
        rank = max(d.template.max_rank for d in drafters)
        candidates = first.heads.logits(first.model, hidden).topk(rank, dim=-1).indices  # [B, K, k]
        trees = [TreeBuilder(c.root_token).build() for c in ctxs]
        for row, b in enumerate(live):
            d, depth = drafters[b], min(drafters[b].template.depth, ctxs[b].max_depth)
            template = d.template if depth == d.template.depth else d._shallow(depth)
            trees[b] = template.fill(ctxs[b].root_token, candidates[row, :depth])
        return trees

    def with_options(self, tree: list[list[int]] | None = None) -> "MedusaDrafter":
        """A drafter sharing these heads with another static tree."""
        other = MedusaDrafter(self.model, self.heads, self.signature)
        other.template = TreeTemplate(tree) if tree is not None else self.template
        if other.template.depth > self.heads.cfg.num_heads:
            raise ValueError(f"tree depth {other.template.depth} exceeds the {self.heads.cfg.num_heads} heads")
        return other

    def _shallow(self, depth: int) -> TreeTemplate:
        return TreeTemplate([p for p in self.template.paths if len(p) <= depth])

    def _dtype(self) -> torch.dtype:
        return self.heads.blocks[0][0].linear.weight.dtype

    def config_dict(self) -> dict:
        return asdict(self.heads.cfg)


def build_medusa(model, **options) -> MedusaDrafter:
    """``build_drafter(model, "medusa", num_heads=4, ...)``: untrained (zero-initialised) heads."""
    cfg = config_from_options("medusa", MedusaConfig, options)
    param = next(model.parameters())
    hidden = model.config.get_text_config(decoder=True).hidden_size
    heads = MedusaHeads(cfg, hidden, model.get_output_embeddings()).to(param.device, param.dtype)
    return MedusaDrafter(model, heads)


def medusa_weights(drafter: MedusaDrafter) -> dict[str, torch.Tensor]:
    """The adapter tensors, all under the ``medusa.`` prefix."""
    return {f"medusa.{k}": v for k, v in drafter.heads.state_dict().items()}


def medusa_from_checkpoint(model, meta: dict, weights: dict[str, torch.Tensor]) -> MedusaDrafter:
    """Rebuild the drafter from a checkpoint already checked against ``model``."""
    from ..checkpoint import adapter_state  # checkpoint imports the drafters package

    try:
        cfg = MedusaConfig(**meta["config"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"medusa checkpoint config is invalid: {err}") from None
    param = next(model.parameters())
    hidden = model.config.get_text_config(decoder=True).hidden_size
    heads = MedusaHeads(cfg, hidden, model.get_output_embeddings() if cfg.own_lm_head else None)
    state = adapter_state(weights, "medusa.", heads.state_dict())
    heads = heads.to(param.device, param.dtype)  # before loading, so values keep their precision
    heads.load_state_dict(state)
    return MedusaDrafter(model, heads)


register("medusa", build_medusa, checkpoint=(medusa_weights, medusa_from_checkpoint), recipe="selfspec.training.recipes.medusa",
         exporter="selfspec.export:medusa_layout", export_format="medusa")
