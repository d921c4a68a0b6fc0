"""Layer-skip self-drafts: draft with the target's own first E layers (or a subset), exit early.

Notation: the target has L decoder layers; the drafter runs layers ``indices`` (default
``0 .. E-1``) of the *unmodified* target, then an optional small adapter, the target's final norm
and its LM head: ``q = softmax(head(norm(adapter(h_E))))``. Adapters (``LayerSkipConfig.adapter``):
``"none"`` (the plain early exit), ``"block"`` (residual blocks ``x + SiLU(W x)`` after layer E,
zero-initialised) or ``"lora"`` (PEFT LoRA on weight-sharing copies of layers ``0 .. E-1``,
:mod:`selfspec.drafters.lora`; B = 0 initially). An untrained adapter of either kind is the plain
early exit. Adapters run only while drafting; verification always runs the full unmodified target,
so output stays exact.

Tree: the level-wise expander shared with EAGLE-3 (:mod:`selfspec.drafters.expander`), every
node forwarded (its KV may go to the verify pass). The checkpoint says which layers draft and the
adapter (:class:`LayerSkipConfig`); how it drafts is a :class:`LayerSkipPolicy`.

KV reuse: when the drafting layers are the first E layers and the adapter comes after them, their
keys / values and outputs for the drafted nodes are exactly what the verify pass would compute.
Given the target's cache (``ctx.cache``), the drafter writes the tree's first-E-layer KV there in
flat order (the last level gets a layers-only pass without the head) and hands ``h_E`` of every node
to the verify pass (a :class:`~selfspec.drafters.base.Proposal` with a handoff), which then runs only layers E..L-1. Otherwise the drafter
keeps its own cache of the drafting layers for the committed tokens (always so with LoRA: the
adapted layers' keys and values are not the target's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from ..model.attention_mask import MaskBuilder
from ..model.kv_cache import cache_length, new_cache
from ..model.layer_slice import LayerSlice, num_layers
from ..model.lm_head import lm_logits
from ..model.target import LayerHandoff
from ..decoding.tree import DraftTree, TreeBuilder
from .base import DraftContext, Drafter, Proposal, Requirements, TargetSignature
from .registry import register
from .expander import TreePolicy, expand, expand_many
from .residual import ResBlock

ADAPTERS = ("none", "block", "lora")


@dataclass
class LayerSkipConfig:
    """Which layers draft and the adapter (what a checkpoint is).

    Attributes:
        exit_layer: E, draft with layers ``0 .. E-1`` (ignored when ``layers`` is given).
        layers: an explicit increasing subset of layers to draft with (Draft & Verify / SWIFT
            style); no KV reuse unless it is ``0 .. E-1``.
        adapter: ``"none"`` (plain early exit), ``"block"`` (trainable residual blocks after the
            last drafting layer) or ``"lora"`` (LoRA adapters on the drafting layers).
        adapter_layers: residual blocks in the ``"block"`` adapter.
        rank / alpha: LoRA rank r and scaling numerator (the update is ``alpha / r * B A``;
            ``"lora"`` adapter).
        target_modules: names of the linear maps that get LoRA adapters (default: every
            ``nn.Linear`` inside a decoder layer, e.g. ``q_proj ... down_proj``).
    """

    exit_layer: int = 8
    layers: list[int] | None = None
    adapter: str = "block"
    adapter_layers: int = 1
    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {self.adapter!r}")
        if self.layers is None and self.exit_layer < 1:
            raise ValueError(f"exit_layer must be >= 1, got {self.exit_layer}")
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("layers must name at least one layer")
        if self.adapter_layers < 1:
            raise ValueError(f"adapter_layers must be >= 1, got {self.adapter_layers}")
        if self.rank < 1 or self.alpha <= 0:
            raise ValueError(f"need rank >= 1 and alpha > 0, got {self.rank}, {self.alpha}")
        if self.adapter == "lora" and self.layers is not None:
            raise ValueError("LoRA adapters go on the first exit_layer layers: leave layers unset")

    @property
    def indices(self) -> list[int]:
        return list(self.layers) if self.layers is not None else list(range(self.exit_layer))


@dataclass(frozen=True)
class LayerSkipPolicy(TreePolicy):
    """How a layer-skip drafter drafts: the tree policy, and ``kv_reuse``: share the target's cache
    and hand layer outputs to the verify pass when the drafter runs alone and can."""

    kv_reuse: bool = True


CONFIG_FIELDS = tuple(f.name for f in fields(LayerSkipConfig))
POLICY_FIELDS = tuple(f.name for f in fields(LayerSkipPolicy))


def split_options(kind: str, options: dict, config_fields=CONFIG_FIELDS, policy_fields=POLICY_FIELDS):
    """``(config options, policy options)`` of ``options``; unknown keys raise ``ValueError``."""
    unknown = set(options) - set(config_fields) - set(policy_fields)
    if unknown:
        raise ValueError(f"unknown {kind} drafter options {sorted(unknown)}; known: {sorted(config_fields + policy_fields)}")
    return ({k: v for k, v in options.items() if k in config_fields},
            {k: v for k, v in options.items() if k in policy_fields})


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

    def __init__(self, model, config: LayerSkipConfig, adapter: ExitAdapter | tuple | None,
                 policy: LayerSkipPolicy | None = None, signature: TargetSignature | None = None):
        """``adapter``: the block adapter, a LoRA ``(root, layers)`` pair of
        :func:`~selfspec.drafters.lora.lora_stack`, or ``None`` (as ``config.adapter`` says)."""
        super().__init__(signature or TargetSignature.of(model), model)
        total = num_layers(model)
        self.indices = config.indices
        if self.indices[-1] >= total:
            raise ValueError(f"the target has {total} layers; cannot draft with layer {self.indices[-1]}")
        if len(self.indices) >= total:
            raise ValueError(f"drafting with all {total} layers is not a draft: choose exit_layer < {total}")
        self.config, self.policy = config, policy or LayerSkipPolicy()
        lora = config.adapter == "lora"
        self.stack, layers = adapter if lora else (None, None)
        self.adapter = adapter.eval() if config.adapter == "block" else None
        self.body = LayerSlice(model, self.indices, final_norm=False, layers=layers)
        self.norm = model.get_decoder().norm
        self.masks = MaskBuilder(model)
        self.requires = Requirements(target_cache=self.policy.kv_reuse and not lora
                                     and self.indices == list(range(len(self.indices))))
        self.reset()

    def reset(self) -> None:
        self.cache, self.cached = new_cache(), 0  # own cache: drafting layers' KV of committed tokens

    def config_dict(self) -> dict:
        return asdict(self.config)

    def _own_length(self) -> int:
        """Slots in the drafter's own cache (read at its first drafting layer: a subset need not
        include layer 0)."""
        return self.cache.get_seq_length(self.indices[0])

    def with_options(self, **options) -> "LayerSkipDrafter":
        """A drafter sharing this one's adapter with other policy options (the drafting layers
        cannot change: the adapter was trained for them)."""
        fixed = set(CONFIG_FIELDS) & set(options)
        if fixed:
            raise ValueError(f"cannot change {sorted(fixed)} of a trained layer-skip drafter")
        _, policy = split_options(self.kind, options)
        adapter = (self.stack, self.body.layers) if self.stack is not None else self.adapter
        return LayerSkipDrafter(self.model, self.config, adapter, LayerSkipPolicy(**(asdict(self.policy) | policy)),
                                self.signature)

    def save_peft(self, folder):
        """Write the LoRA adapters as a standard PEFT folder (``PeftModel.from_pretrained`` on the
        target); ``ValueError`` for other adapters."""
        if self.stack is None:
            raise ValueError(f"a PEFT folder holds LoRA adapters; this drafter's adapter is {self.config.adapter!r}")
        from .lora import save_peft

        return save_peft(self.stack, self.model, folder)

    # ------------------------------------------------------------------ drafting
    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` last drafting layer outputs -> ``[..., V]`` draft logits."""
        if self.adapter is not None:
            h = self.adapter(h)
        return lm_logits(self.model, self.norm(h))

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree | Proposal:
        shared = ctx.cache is not None and self.requires.target_cache
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

        def forward(builder, nodes, parent_rows, depth):
            out = self._forward_nodes(builder, nodes, prefix, cache)
            rows.append(out)
            return self.draft_logits(out)

        tree, last = expand(ctx, self.policy, self.draft_logits(h), forward, vocab=self.signature.vocab_size,
                            forward_all=True)
        if shared:
            if last:  # the last level: a layers-only pass, so every node's KV is in the cache
                builder = _builder_of(tree)
                rows.append(self._forward_nodes(builder, last, prefix, cache))
            return Proposal(tree, LayerHandoff(len(self.indices), torch.cat(rows)))
        extra = self._own_length() - length  # keep the committed tokens and the root
        if extra > 0:
            cache.crop(-extra)
        self.cached = length
        return tree

    @classmethod
    @torch.no_grad()
    def propose_many(cls, drafters: list["LayerSkipDrafter"], ctxs: list[DraftContext]) -> list[DraftTree | Proposal]:
        """Every row's tree with one pass of the drafting layers per level over all rows (forks
        of one drafter, each with its own cache; see :class:`_Rows`). A row given the target's
        cache (decoding alone), or forks of different layers or adapters, draft one by one."""
        kinds = {(id(d.body.layers), id(d.adapter), tuple(d.indices)) for d in drafters}
        shared = any(c.cache is not None and d.requires.target_cache for d, c in zip(drafters, ctxs))
        if len(drafters) < 2 or len(kinds) > 1 or shared:
            return [d.propose(c) for d, c in zip(drafters, ctxs)]
        first = drafters[0]
        rows = _Rows(drafters, [c.tokens for c in ctxs])
        live = [b for b, c in enumerate(ctxs) if c.max_depth >= 1]
        trees = [DraftTree.root_only(c.root_token) for c in ctxs]
        if not live:
            return trees

        def forward_many(calls):
            outs = rows.forward([(live[i], builder, nodes, depth) for i, builder, nodes, _, depth in calls])
            return list(first.draft_logits(torch.cat(outs)).split([o.shape[0] for o in outs]))

        grown = expand_many([ctxs[b] for b in live], first.policy, [first.draft_logits(rows.roots[b]) for b in live],
                            forward_many, vocab=first.signature.vocab_size, forward_all=True)
        for b, (tree, _) in zip(live, grown):
            trees[b] = tree
        return trees

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

    def _forward_nodes(self, builder: TreeBuilder, nodes: list[int], prefix: int, cache) -> torch.Tensor:
        """Run the drafting layers over ``nodes`` (consecutive flat indices, after every earlier
        node) with tree attention; returns their ``[m, H]`` outputs (their KV land in ``cache``
        after the earlier nodes)."""
        lo, hi = nodes[0], nodes[-1] + 1
        anc = torch.zeros(hi, hi, dtype=torch.bool)
        depth = torch.zeros(hi, dtype=torch.long)
        anc[0, 0] = True
        for i in range(1, hi):
            p = builder.parent(i)
            anc[i] = anc[p]
            anc[i, i] = True
            depth[i] = depth[p] + 1
        ids = torch.tensor([builder.token(i) for i in nodes])
        mask = self.masks.tree(anc, depth, prefix, slice(lo, hi))
        pos = (prefix + depth[lo:hi])[None].to(self.masks.device)
        return self.body(input_ids=ids[None].to(self.masks.device), position_ids=pos, attention_mask=mask,
                         cache=cache)[0]


class _Rows:
    """Several layer-skip drafters' caches side by side for one batched draft (one row each).

    Built from each drafter's own cache of the drafting layers (``[1, kv_heads, P_b, d]`` per
    layer, zero-padded to the longest into one ``DynamicCache`` of ``[B, kv_heads, S, d]``), it
    runs every row's committed tokens not yet cached, up to and including its root, in one pass
    of the drafting layers, and stores each row's new keys and values back in its drafter's
    cache; tree levels then append their keys here only (each row's queries see its own committed
    slots and its node's ancestors), so the drafters keep committed tokens only, as alone.

    Attributes:
        seen: ``[B, T]`` bool, the slots holding row b's committed tokens; k_pos: ``[B, T]`` each
            slot's position; prefix: ``[B]`` committed tokens before each row's root; roots:
            each row's ``[1, H]`` output at its root.
    """

    def __init__(self, drafters: list[LayerSkipDrafter], tokens: list[torch.Tensor]):
        first = drafters[0]
        self.body, self.masks, self.layers = first.body, first.masks, first.indices
        dev = self.masks.device
        B = len(drafters)
        self.prefix = [t.shape[0] - 1 for t in tokens]
        starts = [min(d.cached, p) for d, p in zip(drafters, self.prefix)]
        for d, start in zip(drafters, starts):
            if d._own_length() > start:
                d.cache.crop(-(d._own_length() - start))
        S, self.cache = max(starts), new_cache()
        if S > 0:
            ref = next(d.cache.layers[self.layers[0]] for d, s in zip(drafters, starts) if s)
            for layer in self.layers:
                keys = ref.keys.new_zeros((B,) + tuple(ref.keys.shape[1:2]) + (S,) + tuple(ref.keys.shape[3:]))
                values = ref.values.new_zeros((B,) + tuple(ref.values.shape[1:2]) + (S,) + tuple(ref.values.shape[3:]))
                for b, (d, s) in enumerate(zip(drafters, starts)):
                    if s:
                        keys[b, :, :s], values[b, :, :s] = d.cache.layers[layer].keys[0], d.cache.layers[layer].values[0]
                self.cache.update(keys, values, layer)
        self.seen = torch.arange(S)[None, :] < torch.tensor(starts)[:, None]
        self.k_pos = torch.arange(S).expand(B, S).clone()
        need = [p + 1 - s for p, s in zip(self.prefix, starts)]  # committed tokens to run, the root last
        M = max(need)
        ids = torch.zeros(B, M, dtype=torch.long)
        q_pos = torch.zeros(B, M, dtype=torch.long)
        visible = torch.zeros(B, M, S + M, dtype=torch.bool)
        visible[:, :, S:] = torch.eye(M, dtype=torch.bool)  # pads: themselves only
        for b, (t, s, m) in enumerate(zip(tokens, starts, need)):
            ids[b, :m] = t[s: s + m]
            q_pos[b, :m] = torch.arange(s, s + m)
            visible[b, :m, :S] = self.seen[b]
            visible[b, :m, S: S + m] = torch.ones(m, m, dtype=torch.bool).tril()
        k_pos = torch.cat([self.k_pos, q_pos], dim=1)
        h = self.body(input_ids=ids.to(dev), position_ids=q_pos.to(dev), cache=self.cache,
                      attention_mask=self.masks.build(visible, q_pos, k_pos))
        self.roots = [h[b, m - 1: m] for b, m in enumerate(need)]
        for b, (d, m) in enumerate(zip(drafters, need)):
            for layer in self.layers:
                held = self.cache.layers[layer]
                d.cache.update(held.keys[b: b + 1, :, S: S + m], held.values[b: b + 1, :, S: S + m], layer)
            d.cached = self.prefix[b] + 1
        self.seen = torch.cat([self.seen, torch.arange(M)[None, :] < torch.tensor(need)[:, None]], dim=1)
        self.k_pos = k_pos
        self.slots: dict[int, dict[int, int]] = {}  # row -> forwarded node -> its key slot

    def forward(self, calls: list[tuple[int, TreeBuilder, list[int], int]]) -> list[torch.Tensor]:
        """One pass of the drafting layers over tree level ``depth`` of each ``(row, builder,
        nodes, depth)`` call (every row's earlier nodes are in the cache: every node is
        forwarded); returns each call's ``[f, H]`` outputs."""
        B, T = self.seen.shape
        F = max(len(nodes) for _, _, nodes, _ in calls)
        ids = torch.zeros(B, F, dtype=torch.long)
        q_pos = torch.zeros(B, F, dtype=torch.long)
        visible = torch.zeros(B, F, T + F, dtype=torch.bool)
        visible[:, :, T:] = torch.eye(F, dtype=torch.bool)
        for b, builder, nodes, depth in calls:
            slots = self.slots.setdefault(b, {})
            ids[b, : len(nodes)] = torch.tensor([builder.token(n) for n in nodes])
            q_pos[b, : len(nodes)] = self.prefix[b] + depth
            visible[b, : len(nodes), :T] = self.seen[b]
            for j, node in enumerate(nodes):
                up = builder.parent(node)
                while up > 0:
                    visible[b, j, slots[up]] = True
                    up = builder.parent(up)
                slots[node] = T + j
        k_pos = torch.cat([self.k_pos, q_pos], dim=1)
        dev = self.masks.device
        h = self.body(input_ids=ids.to(dev), position_ids=q_pos.to(dev), cache=self.cache,
                      attention_mask=self.masks.build(visible, q_pos, k_pos))
        self.seen = torch.cat([self.seen, torch.zeros(B, F, dtype=torch.bool)], dim=1)
        self.k_pos = k_pos
        return [h[b, : len(nodes)] for b, _, nodes, _ in calls]


def _builder_of(tree: DraftTree) -> TreeBuilder:
    """A builder holding ``tree``'s nodes (to read tokens and parents as the expander's callback does)."""
    builder = TreeBuilder(int(tree.tokens[0]))
    for t, p in zip(tree.tokens.tolist()[1:], tree.parents.tolist()[1:]):
        builder.add(p, t)
    return builder


def build_layerskip(model, **options) -> LayerSkipDrafter:
    """``build_drafter(model, "layerskip", exit_layer=8, adapter="block", ...)``: an untrained
    adapter (= the plain exit)."""
    config, policy = split_options("layerskip", options)
    cfg = LayerSkipConfig(**config)
    param = next(model.parameters())
    adapter = None
    if cfg.adapter == "block":
        hidden = model.config.get_text_config(decoder=True).hidden_size
        adapter = ExitAdapter(hidden, cfg.adapter_layers).to(param.device, param.dtype)
    elif cfg.adapter == "lora":
        from .lora import lora_stack

        adapter = lora_stack(model, cfg.exit_layer, cfg.rank, cfg.alpha, cfg.target_modules)
    return LayerSkipDrafter(model, cfg, adapter, LayerSkipPolicy(**policy))


def layerskip_weights(drafter: LayerSkipDrafter) -> dict[str, torch.Tensor]:
    """The adapter tensors: block under ``layerskip.``, LoRA under ``lora.`` (PEFT's names); none
    for the plain early exit."""
    if drafter.stack is not None:
        from .lora import lora_state

        return {f"lora.{k}": v for k, v in lora_state(drafter.stack).items()}
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
    if drafter.stack is not None:
        from .lora import load_lora_state, lora_state

        load_lora_state(drafter.stack, adapter_state(weights, "lora.", lora_state(drafter.stack)))
        return drafter
    state = adapter_state(weights, "layerskip.", drafter.adapter.state_dict() if drafter.adapter is not None else {})
    if drafter.adapter is not None:
        drafter.adapter.load_state_dict(state)
    return drafter


register("layerskip", build_layerskip, checkpoint=(layerskip_weights, layerskip_from_checkpoint),
         recipe="selfspec.training.recipes.layerskip")
