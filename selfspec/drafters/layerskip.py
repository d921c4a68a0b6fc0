"""Layer-skip self-drafts: draft with the target's own first E layers (or a subset), exit early.

Notation: the target has L decoder layers; the drafter runs layers ``indices`` (default
``0 .. E-1``) of the *unmodified* target, then an optional small adapter, the target's final norm
and its LM head: ``q = softmax(head(norm(adapter(h_E))))``. The adapter (``"block"``: residual
blocks ``x + SiLU(W x)``, zero-initialised, so an untrained adapter is the plain early exit) runs
only while drafting; verification always runs the full unmodified target, so output stays exact.

Tree (EAGLE-2 style, dynamic by draft confidence): level by level, every node of the current
level is forwarded in one pass; each node's ``branch`` most likely tokens become candidates scored
by their path's draft probability; the best ``width`` candidates with score >= ``min_score`` (and
within ``max_nodes``) form the next level. Drafting stops at ``max_depth``, when the node budget is
spent, or when no candidate is confident enough. Greedy targets get point-mass children; sampling
targets (with ``sampled``) get, per chosen parent, the same number of children drawn without
replacement from ``q`` (the target's temperature / top-k / top-p applied to the draft logits),
recorded as ``Law.WOR`` with their ``q``: the number of draws per parent depends only on ``q`` and
on earlier nodes, never on the draws themselves, which keeps rejection sampling exact.

KV reuse: when the drafting layers are the first E layers and the adapter comes after them, their
keys / values and outputs for the drafted nodes are exactly what the verify pass would compute.
Given the target's cache (``ctx.cache``), the drafter writes the tree's first-E-layer KV there in
flat order (the last level gets a layers-only pass without the head) and hands ``h_E`` of every node
to the verify pass (a :class:`~selfspec.drafters.base.Proposal` with a handoff), which then runs only layers E..L-1. Otherwise the drafter
keeps its own cache of the drafting layers for the committed tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..attention_mask import MaskBuilder
from ..kv_cache import cache_length, new_cache
from ..layer_slice import LayerSlice, num_layers
from ..lm_head import lm_logits
from ..sampling import draw_without_replacement, target_probs
from ..target import LayerHandoff
from ..tree import DraftTree, Law, TreeBuilder
from .base import DraftContext, Drafter, Proposal, TargetSignature
from .dynamic_tree import pick_slots
from .residual import ResBlock

ADAPTERS = ("none", "block")


@dataclass
class LayerSkipConfig:
    """Which layers draft, the adapter, and the tree policy.

    Attributes:
        exit_layer: E, draft with layers ``0 .. E-1`` (ignored when ``layers`` is given).
        layers: an explicit increasing subset of layers to draft with (Draft & Verify / SWIFT
            style); no KV reuse unless it is ``0 .. E-1``.
        adapter: ``"none"`` (plain early exit) or ``"block"`` (trainable residual blocks after the
            last drafting layer).
        adapter_layers: residual blocks in the ``"block"`` adapter.
        max_depth: deepest draft level.
        max_nodes: most draft nodes per step (root excluded).
        width: most nodes per level.
        branch: candidate tokens considered per node.
        min_score: a candidate whose path draft probability is below this is not drafted.
        kv_reuse: share the target's cache and hand layer outputs to the verify pass when possible.
        sampled: at temperature > 0, draw children from ``q`` (else top tokens as point masses).
    """

    exit_layer: int = 8
    layers: list[int] | None = None
    adapter: str = "block"
    adapter_layers: int = 1
    max_depth: int = 6
    max_nodes: int = 12
    width: int = 4
    branch: int = 3
    min_score: float = 0.05
    kv_reuse: bool = True
    sampled: bool = True

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {self.adapter!r}")
        if self.layers is None and self.exit_layer < 1:
            raise ValueError(f"exit_layer must be >= 1, got {self.exit_layer}")
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("layers must name at least one layer")
        for name in ("adapter_layers", "max_depth", "max_nodes", "width", "branch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.min_score < 1.0:
            raise ValueError(f"min_score must be in [0, 1), got {self.min_score}")

    @property
    def indices(self) -> list[int]:
        return list(self.layers) if self.layers is not None else list(range(self.exit_layer))


class ExitAdapter(nn.Module):
    """Residual blocks applied to the last drafting layer's output (identity when untrained)."""

    def __init__(self, hidden: int, num_layers: int):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.blocks(h)


class LayerSkipDrafter(Drafter):
    """Drafts with the target's own first layers (see the module docstring)."""

    kind = "layerskip"

    def __init__(self, model, cfg: LayerSkipConfig, adapter: ExitAdapter | None,
                 signature: TargetSignature | None = None):
        super().__init__(signature or TargetSignature.of(model))
        total = num_layers(model)
        self.indices = cfg.indices
        if self.indices[-1] >= total:
            raise ValueError(f"the target has {total} layers; cannot draft with layer {self.indices[-1]}")
        if len(self.indices) >= total:
            raise ValueError(f"drafting with all {total} layers is not a draft: choose exit_layer < {total}")
        self.model, self.cfg = model, cfg
        self.adapter = adapter.eval() if adapter is not None else None
        self.body = LayerSlice(model, self.indices, final_norm=False)
        self.norm = model.get_decoder().norm
        self.masks = MaskBuilder(model)
        self.shares_target_cache = cfg.kv_reuse and self.indices == list(range(len(self.indices)))
        self.reset()

    def reset(self) -> None:
        self.cache, self.cached = new_cache(), 0  # own cache: drafting layers' KV of committed tokens

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def _own_length(self) -> int:
        """Slots in the drafter's own cache (read at its first drafting layer: a subset need not
        include layer 0)."""
        return self.cache.get_seq_length(self.indices[0])

    def with_options(self, **options) -> "LayerSkipDrafter":
        """A drafter sharing this one's adapter with some tree options changed (the drafting
        layers cannot change: the adapter was trained for them)."""
        fixed = {"exit_layer", "layers", "adapter", "adapter_layers"} & set(options)
        if fixed:
            raise ValueError(f"cannot change {sorted(fixed)} of a trained layer-skip drafter")
        unknown = set(options) - set(asdict(self.cfg))
        if unknown:
            raise ValueError(f"unknown layerskip drafter options {sorted(unknown)}")
        other = LayerSkipDrafter(self.model, LayerSkipConfig(**(asdict(self.cfg) | options)), self.adapter, self.signature)
        other.checkpoint_meta = getattr(self, "checkpoint_meta", None)
        return other

    # ------------------------------------------------------------------ drafting
    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` last drafting layer outputs -> ``[..., V]`` draft logits."""
        if self.adapter is not None:
            h = self.adapter(h)
        return lm_logits(self.model, self.norm(h))

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree | Proposal:
        cfg = self.cfg
        shared = ctx.cache is not None and self.shares_target_cache
        tokens = ctx.tokens
        length = tokens.shape[0]
        prefix = length - 1  # committed tokens before the root
        if shared:
            cache, start = ctx.cache, cache_length(ctx.cache)
            if start != prefix:
                raise RuntimeError(f"target cache holds {start} slots, expected {prefix}")
        else:
            cache, start = self.cache, min(self.cached, prefix)
            if self._own_length() > start:
                cache.crop(-(self._own_length() - start))
        h = self._catch_up(tokens[start:length], start, cache)  # [1, H]: the root's output
        rows = [h]  # h_E per tree node, flat order
        builder = TreeBuilder(ctx.root_token)
        parents, depths, scores = [-1], [0], [1.0]
        anc = torch.zeros(cfg.max_nodes + 1, cfg.max_nodes + 1, dtype=torch.bool)
        anc[0, 0] = True
        level = [0]
        logits = self.draft_logits(h)  # [1, V]
        max_depth = min(cfg.max_depth, ctx.max_depth)
        sampled = cfg.sampled and not ctx.sampling.greedy
        for depth in range(1, max_depth + 1):
            q_score = logits.float().softmax(-1)  # [m, V] confidence used to shape the tree
            top = q_score.topk(min(cfg.branch, q_score.shape[-1]), dim=-1)
            room = min(cfg.width, cfg.max_nodes + 1 - len(parents))
            chosen = pick_slots(torch.tensor([scores[a] for a in level]), top.values.cpu(), room, cfg.min_score)
            if not chosen:
                break
            new_nodes = []
            for j, ranks in chosen.items():
                parent = level[j]
                if sampled:
                    q = target_probs(logits[j], ctx.sampling)
                    builder.set_draft_probs(parent, q)
                    count = min(len(ranks), int((q > 0).sum()))
                    draws = draw_without_replacement(q, count, ctx.generator)
                    kids = [(t, Law.WOR, float(q_score[j, t])) for t in draws]
                else:
                    kids = [(int(top.indices[j, r]), Law.POINT, float(top.values[j, r])) for r in ranks]
                for token, law, p in kids:
                    node = builder.add(parent, token, law)
                    parents.append(parent)
                    depths.append(depth)
                    scores.append(scores[parent] * p)
                    anc[node] = anc[parent]
                    anc[node, node] = True
                    new_nodes.append(node)
            last = depth == max_depth or len(parents) > cfg.max_nodes
            if not last or shared:
                h = self._forward_nodes(builder, new_nodes, anc, depths, prefix, cache)
                rows.append(h)
            if last:
                break
            logits = self.draft_logits(h)
            level = new_nodes
        tree = builder.build()
        if shared:
            return Proposal(tree, LayerHandoff(len(self.indices), torch.cat(rows)))
        else:
            extra = self._own_length() - length  # keep the committed tokens and the root
            if extra > 0:
                cache.crop(-extra)
            self.cached = length
        return tree

    def _catch_up(self, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
        """Pass 1: the committed tokens ``ids`` (``[m]``, at positions ``start..``) the cache lacks,
        ending with the root (shared cache: the root only); returns the root's ``[1, H]`` output."""
        m = ids.shape[0]
        visible = torch.ones(m, start + m, dtype=torch.bool)
        visible[:, start:] = torch.ones(m, m, dtype=torch.bool).tril()
        pos = torch.arange(start, start + m)
        h = self.body(input_ids=ids[None].to(self.masks.device), position_ids=pos[None].to(self.masks.device),
                      attention_mask=self.masks.build(visible, pos, torch.arange(start + m)), cache=cache)[0]
        return h[-1:]

    def _forward_nodes(self, builder: TreeBuilder, nodes: list[int], anc: torch.Tensor, depths: list[int],
                       prefix: int, cache) -> torch.Tensor:
        """Run the drafting layers over ``nodes`` (consecutive flat indices) with tree attention;
        returns their ``[m, H]`` outputs (their KV land in ``cache`` after the earlier nodes)."""
        lo, hi = nodes[0], nodes[-1] + 1
        ids = torch.tensor([builder.token(i) for i in nodes])
        depth = torch.tensor(depths[:hi])
        mask = self.masks.tree(anc[:hi, :hi], depth, prefix, slice(lo, hi))
        pos = (prefix + depth[lo:hi])[None].to(self.masks.device)
        return self.body(input_ids=ids[None].to(self.masks.device), position_ids=pos, attention_mask=mask,
                         cache=cache)[0]


def build_layerskip(model, **options) -> LayerSkipDrafter:
    """``build_drafter(model, "layerskip", exit_layer=8, ...)``: an untrained adapter (= plain exit)."""
    cfg = LayerSkipConfig(**options)
    param = next(model.parameters())
    adapter = None
    if cfg.adapter == "block":
        hidden = model.config.get_text_config(decoder=True).hidden_size
        adapter = ExitAdapter(hidden, cfg.adapter_layers).to(param.device, param.dtype)
    return LayerSkipDrafter(model, cfg, adapter)


def layerskip_weights(drafter: LayerSkipDrafter) -> dict[str, torch.Tensor]:
    """The adapter tensors under the ``layerskip.`` prefix (none for the plain early exit)."""
    if drafter.adapter is None:
        return {}
    return {f"layerskip.{k}": v for k, v in drafter.adapter.state_dict().items()}


def layerskip_from_checkpoint(model, meta: dict, weights: dict[str, torch.Tensor]) -> LayerSkipDrafter:
    """Rebuild the drafter from a checkpoint already checked against ``model``."""
    from ..checkpoint import adapter_state  # checkpoint imports the drafters package

    try:
        cfg = LayerSkipConfig(**meta["config"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"layerskip checkpoint config is invalid: {err}") from None
    drafter = build_layerskip(model, **asdict(cfg))
    state = adapter_state(weights, "layerskip.", drafter.adapter.state_dict() if drafter.adapter is not None else {})
    if drafter.adapter is not None:
        drafter.adapter.load_state_dict(state)
    return drafter
