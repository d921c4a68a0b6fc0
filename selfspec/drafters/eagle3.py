"""EAGLE-3 drafter: an autoregressive one-layer head on fused low / middle / high target features.

The head (:mod:`selfspec.drafters.eagle3_head`) keeps its own KV cache of *committed pairs*: pair t
= (fused taps of position t, embedding of token t + 1), t = 0 .. P - 1 with P = len(tokens) - 1, so
the last committed pair ends with the root and its output predicts the first draft level. The
verify pass records the taps of every committed position (:mod:`selfspec.model.taps`), which the engine
shows in ``ctx.features``; each ``propose`` first runs the pairs it has not run yet (one fused call,
which also yields the first level; after steps it did not draft, all of them at once), then one
fused call per draft level (:mod:`selfspec.drafters.expander`), and finally drops the tree's keys
from its cache: the cache then holds exactly the committed pairs computed from the target's own
features, as a fresh recomputation would (tested).

The checkpoint says what the head is (:class:`Eagle3Config`); how it drafts is a
:class:`~selfspec.drafters.expander.TreePolicy` plus ``head_weights`` (native or an int8 copy).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import asdict, dataclass, fields

import torch

from ..kernels.int8_linear import quantize_linears
from ..decoding.tree import DraftTree
from .base import DraftContext, Drafter, Requirements, TargetSignature
from .registry import register
from .eagle3_head import Eagle3Head, default_taps, draft_layer_config
from .expander import TreePolicy, expand_many

HEAD_WEIGHTS = ("auto", "native", "int8")
_INT8_COPIES: "weakref.WeakKeyDictionary[Eagle3Head, tuple]" = weakref.WeakKeyDictionary()  # head -> (key, copy)


@dataclass
class Eagle3Config:
    """What the head is (its checkpoint's shape).

    Attributes:
        taps: target taps fused by ``fc`` (transformers ``hidden_states`` indices); default the
            inputs of layers 2, L // 2 and L - 3 (vLLM's and SGLang's default).
        draft_vocab_size: V_d, size of the reduced draft vocabulary (<= the target's).
        intermediate_size: MLP width of the draft layer (default: the target's).
    """

    taps: list[int] | None = None
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.taps is not None and len(self.taps) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 taps, got {self.taps}")


@dataclass(frozen=True)
class Eagle3Policy(TreePolicy):
    """How the head drafts: the tree policy, and ``head_weights``: ``"native"`` drafts with the
    head's weights as they are; ``"int8"`` with an int8 weight-only copy of its linear layers
    (:mod:`selfspec.kernels.int8_linear`: half the bytes a draft call reads; drafts only); ``"auto"``:
    int8 where the head runs in bf16 on a CPU whose int8 kernel passes its check, else native (there
    the int8 draft step is faster than the unpacked bf16 one; the measurement is in
    docs/decisions.md)."""

    head_weights: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_weights not in HEAD_WEIGHTS:
            raise ValueError(f"head_weights must be one of {HEAD_WEIGHTS}, got {self.head_weights!r}")


HEAD_FIELDS = tuple(f.name for f in fields(Eagle3Config))
POLICY_FIELDS = tuple(f.name for f in fields(Eagle3Policy))


class Eagle3Drafter(Drafter):
    """Drafts dynamic trees with an :class:`Eagle3Head` (see the module docstring)."""

    kind = "eagle3"

    def __init__(self, model, config: Eagle3Config, head: Eagle3Head, policy: Eagle3Policy | None = None,
                 signature: TargetSignature | None = None, acceptance: dict | None = None):
        super().__init__(signature or TargetSignature.of(model), model)
        self.config, self.policy, self.head = config, policy or Eagle3Policy(), head.eval()
        self.requires = Requirements(taps=tuple(config.taps))
        self.acceptance = acceptance  # measured acceptance (the checkpoint's), the controller's prior
        self.embed = model.get_input_embeddings()
        self._draft_ids = head.draft_ids if head.draft_ids.is_meta else head.draft_ids.to("cpu")
        if not head.fc.weight.is_meta:
            self.run_head  # an int8 copy is built now, at load time, not inside the first timed generation
        self.reset()

    @property
    def run_head(self) -> Eagle3Head:
        """The head drafting runs: :attr:`head` itself, or (``head_weights="int8"``) an int8 copy
        of it, shared by the drafters of one head (:meth:`with_options`) and rebuilt whenever the
        head's parameters change (never stale); ``"auto"`` picks as :class:`Eagle3Policy` says."""
        weights = self.policy.head_weights
        if weights == "auto":
            p = self.head.fc.weight
            if p.device.type != "cpu" or p.dtype != torch.bfloat16:
                return self.head
        elif weights == "native":
            return self.head
        key = tuple((p.data_ptr(), p._version) for p in self.head.parameters())
        held = _INT8_COPIES.get(self.head)
        if held is None or held[0] != key:
            runtime = copy.deepcopy(self.head)
            quantize_linears(runtime)
            held = _INT8_COPIES[self.head] = (key, runtime.eval())
        if weights == "auto" and not getattr(held[1].lm_head, "kernel", False):
            return self.head  # no int8 kernel here: the copy would only dequantize
        return held[1]

    def reset(self) -> None:
        self.k = self.v = None  # [kv_heads, P, d]: keys / values of the committed pairs
        self.cached = 0
        self._last = None  # [1, H] output of the last committed pair

    def prior(self) -> dict | None:
        return self.acceptance

    def config_dict(self) -> dict:
        return asdict(self.config)

    def with_options(self, **options) -> "Eagle3Drafter":
        """A drafter sharing this head with other policy options (the head's shape cannot change)."""
        fixed = set(HEAD_FIELDS) & set(options)
        if fixed:
            raise ValueError(f"cannot change {sorted(fixed)} of a trained eagle3 drafter")
        unknown = set(options) - set(POLICY_FIELDS)
        if unknown:
            raise ValueError(f"unknown eagle3 drafter options {sorted(unknown)}; known: {sorted(POLICY_FIELDS)}")
        policy = Eagle3Policy(**(asdict(self.policy) | options))
        return Eagle3Drafter(self.model, self.config, self.head, policy, self.signature, self.acceptance)

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        return self.propose_many([self], [ctx])[0]

    @classmethod
    @torch.no_grad()
    def propose_many(cls, drafters: list["Eagle3Drafter"], ctxs: list[DraftContext]) -> list[DraftTree]:
        """Trees for several rows of a batch in one head call per level (forks of one drafter;
        forks of different heads are drafted head by head). Each row's tree is the one it would
        draft alone: its own committed pairs, generator and policy (rows' keys sit side by side in
        one padded tensor, each row's queries see only its own; see :class:`_Rows`)."""
        heads: dict[int, list[int]] = {}
        for b, d in enumerate(drafters):
            heads.setdefault(id(d.head), []).append(b)
        if len(heads) > 1:
            trees: list = [None] * len(drafters)
            for group in heads.values():
                for b, tree in zip(group, cls.propose_many([drafters[b] for b in group], [ctxs[b] for b in group])):
                    trees[b] = tree
            return trees
        rows = _Rows(drafters, [c.tokens for c in ctxs], [c.features for c in ctxs])
        first = drafters[0]
        head, (dev, dtype) = first.run_head, first._device_dtype()
        live = [b for b, c in enumerate(ctxs) if rows.roots[b] is not None and c.max_depth >= 1]
        trees = [DraftTree.root_only(c.root_token) for c in ctxs]
        if not live:
            return trees
        outs = {b: rows.roots[b] for b in live}  # [f, H] outputs of each row's last forwarded level
        slots: dict[tuple[int, int], int] = {}  # (row, forwarded node) -> its key slot

        def forward_many(calls):
            B, T, F = len(drafters), rows.width, max(len(c[2]) for c in calls)
            ids = torch.zeros(B, F, dtype=torch.long)
            feats = torch.zeros(B, F, outs[live[0]].shape[-1], device=dev, dtype=dtype)
            pos = torch.zeros(B, F, dtype=torch.long)
            visible = torch.zeros(B, F, T + F, dtype=torch.bool)
            visible[:, :, T:] = torch.eye(F, dtype=torch.bool)  # pads: themselves only
            for i, builder, nodes, parent_rows, depth in calls:
                b, f = live[i], len(nodes)
                ids[b, :f] = torch.tensor([builder.token(n) for n in nodes])
                feats[b, :f] = outs[b][parent_rows]
                pos[b, :f] = rows.committed[b] - 1 + depth
                visible[b, :f, :T] = rows.seen[b]
                for j, node in enumerate(nodes):
                    up = builder.parent(node)
                    while up > 0:
                        visible[b, j, slots[b, up]] = True
                        up = builder.parent(up)
                for j, node in enumerate(nodes):
                    slots[b, node] = T + j
            out = rows.step(head, first.embed(ids.to(dev)).to(dtype), feats, pos.to(dev), visible)
            answers = []
            for i, _, nodes, _, _ in calls:
                b = live[i]
                outs[b] = out[b, : len(nodes)]
                answers.append(outs[b])
            sizes = [a.shape[0] for a in answers]
            return list(head.logits(torch.cat(answers)).split(sizes))

        grown = expand_many([ctxs[b] for b in live], first.policy, [head.logits(outs[b]) for b in live], forward_many,
                            vocab=first.signature.vocab_size, draft_ids=first._draft_ids, t2d=first._t2d_index)
        for b, (tree, _) in zip(live, grown):
            trees[b] = tree
        return trees

    @property
    def _t2d_index(self) -> torch.Tensor:
        """``[V]`` draft id of each target id (-1 outside the draft vocabulary)."""
        index = self.__dict__.get("_t2d_cache")
        if index is None:
            index = torch.full((self.signature.vocab_size,), -1, dtype=torch.long)
            index[self._draft_ids] = torch.arange(self._draft_ids.shape[0])
            self.__dict__["_t2d_cache"] = index
        return index

    def _device_dtype(self):
        p = self.head.fc.weight
        return p.device, p.dtype


def build_eagle3(model, **options) -> Eagle3Drafter:
    """``build_drafter(model, "eagle3", ...)``: an untrained head (head fields of
    :class:`Eagle3Config`, policy fields of :class:`Eagle3Policy`) whose draft vocabulary is the
    first ``draft_vocab_size`` token ids (training picks the most frequent ones)."""
    unknown = set(options) - set(HEAD_FIELDS) - set(POLICY_FIELDS)
    if unknown:
        raise ValueError(f"unknown eagle3 drafter options {sorted(unknown)}; known: {sorted(HEAD_FIELDS + POLICY_FIELDS)}")
    cfg = Eagle3Config(**{k: v for k, v in options.items() if k in HEAD_FIELDS})
    policy = Eagle3Policy(**{k: v for k, v in options.items() if k in POLICY_FIELDS})
    text = model.config.get_text_config(decoder=True)
    layers, vocab = int(text.num_hidden_layers), int(text.vocab_size)
    cfg.taps = list(cfg.taps) if cfg.taps is not None else default_taps(layers)
    if not all(0 <= k <= layers for k in cfg.taps):
        raise ValueError(f"taps {cfg.taps} outside [0, {layers}] for a target with {layers} layers")
    if cfg.draft_vocab_size > vocab:
        raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary ({vocab})")
    head = Eagle3Head(draft_layer_config(model, cfg.intermediate_size), cfg.draft_vocab_size)
    head.set_vocab(torch.arange(cfg.draft_vocab_size))
    param = next(model.parameters())
    return Eagle3Drafter(model, cfg, head.to(param.device, param.dtype), policy)


def eagle3_weights(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The head's tensors under the ``eagle3.`` prefix (d2t / t2d included)."""
    return {f"eagle3.{k}": v for k, v in drafter.head.state_dict().items()}


def eagle3_from_checkpoint(model, meta: dict, weights: dict[str, torch.Tensor]) -> Eagle3Drafter:
    """Rebuild the drafter from a checkpoint already checked against ``model``: the head from
    ``config``, its measured ``acceptance`` (``meta["extra"]``) as the controller's prior."""
    from ..checkpoint import adapter_state  # checkpoint imports the drafters package

    config = meta.get("config")
    if not isinstance(config, dict):
        raise ValueError("eagle3 checkpoint has no config")
    try:
        cfg = Eagle3Config(**config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"eagle3 checkpoint config is invalid: {err}") from None
    drafter = build_eagle3(model, **asdict(cfg))
    state = adapter_state(weights, "eagle3.", drafter.head.state_dict())
    drafter.head.load_state_dict({k: v.to(drafter.head.state_dict()[k].dtype) for k, v in state.items()})
    drafter._draft_ids = drafter.head.draft_ids.to("cpu")
    drafter.acceptance = _acceptance(meta.get("extra") or {})
    return drafter


def _acceptance(extra: dict) -> dict | None:
    """The checkpoint's measured acceptance ``{"greedy" | "sampled": [[rate per rank] per depth]}``:
    its ``acceptance`` record (``scripts/calibrate.py``) where there is one, else the rank-0 rates
    its training evaluation measured per depth (``eval/top1_per_step``, ``eval/accept_t1_per_step``)."""
    stored = extra.get("acceptance")
    if isinstance(stored, dict):
        return {k: v for k, v in stored.items() if k in ("greedy", "sampled") and isinstance(v, list)} or None
    ev = extra.get("eval") or {}
    top1, t1 = ev.get("eval/top1_per_step"), ev.get("eval/accept_t1_per_step")
    out = {}
    if isinstance(top1, list) and top1:  # teacher-forced, so conditional on the path: a product gives depth d
        out["greedy"] = [[float(x)] for x in top1]
    if isinstance(t1, list) and t1:
        out["sampled"] = [[float(x)] for x in t1]
    return out or None


register("eagle3", build_eagle3, checkpoint=(eagle3_weights, eagle3_from_checkpoint), recipe="selfspec.training.recipes.eagle3",
         exporter="selfspec.export:eagle3_layout", export_format="eagle3")


class _Rows:
    """Several drafters' committed pairs side by side for one batched draft (one row each).

    Built from each drafter's cache (``[kv_heads, P_b, d]``, zero-padded to the longest), it first
    catches every row up on its committed pairs in one :meth:`Eagle3Head.step_many` call (rows
    with nothing new get pad pairs) and stores each row's new keys back in its drafter; tree
    levels then append their keys here only, so the drafters' caches keep committed pairs only.

    Attributes:
        keys / values: ``[B, kv_heads, T, d]`` (``None`` while T = 0).
        seen: ``[B, T]`` bool, the slots holding row b's committed pairs (the rest: other rows'
            holes, pads, and tree levels).
        committed: ``[B]`` committed pairs per row; roots: each row's last pair output ``[1, H]``
            (``None`` for a row with none).
    """

    def __init__(self, drafters: list[Eagle3Drafter], tokens: list[torch.Tensor], features: list):
        self.committed = [t.shape[0] - 1 for t in tokens]
        for d, n, f in zip(drafters, self.committed, features):
            if d.cached > n:
                raise RuntimeError(f"eagle3 drafter holds {d.cached} pairs but only {n} positions are "
                                   "committed (a new generation without reset?)")
            if d.cached < n and (f is None or f.shape[0] < n):
                raise RuntimeError(f"eagle3 drafter needs the taps of all {n} committed positions, got "
                                   f"{0 if f is None else f.shape[0]}")
        first = drafters[0]
        head, (dev, dtype) = first.run_head, first._device_dtype()
        B, S = len(drafters), max(d.cached for d in drafters)
        if B == 1:
            self.keys, self.values = (None, None) if S == 0 else (first.k[None], first.v[None])
        elif S == 0:
            self.keys = self.values = None
        else:
            shape = (B, head.midlayer.self_attn.kv_heads, S, head.midlayer.self_attn.head_dim)
            ref = next(d for d in drafters if d.cached)
            self.keys, self.values = ref.k.new_zeros(shape), ref.v.new_zeros(shape)
            for b, d in enumerate(drafters):
                if d.cached:
                    self.keys[b, :, : d.cached], self.values[b, :, : d.cached] = d.k, d.v
        self.seen = torch.arange(S)[None, :] < torch.tensor([d.cached for d in drafters])[:, None]
        need = [n - d.cached for d, n in zip(drafters, self.committed)]
        M = max(need)
        if M > 0:
            lo = [d.cached for d in drafters]
            fused = head.fuse(torch.cat([f[lo[b]: lo[b] + m] for b, (f, m) in enumerate(zip(features, need)) if m]
                                        ).to(dev, dtype)).split([m for m in need if m])
            embeds = first.embed(torch.cat([t[lo[b] + 1: lo[b] + 1 + m] for b, (t, m) in enumerate(zip(tokens, need))
                                            if m]).to(dev)).to(dtype).split([m for m in need if m])
            feats = torch.zeros(B, M, fused[0].shape[-1], device=dev, dtype=dtype)
            emb = torch.zeros_like(feats)
            pos = torch.zeros(B, M, dtype=torch.long)
            visible = torch.zeros(B, M, S + M, dtype=torch.bool)
            visible[:, :, S:] = torch.eye(M, dtype=torch.bool)
            k = 0
            for b, m in enumerate(need):
                if m:
                    feats[b, :m], emb[b, :m] = fused[k], embeds[k]
                    k += 1
                    pos[b, :m] = torch.arange(lo[b], lo[b] + m)
                    visible[b, :m, :S] = self.seen[b]
                    visible[b, :m, S:S + m] = torch.ones(m, m, dtype=torch.bool).tril()
            last = torch.tensor([max(m - 1, 0) for m in need])
            out, new_k, new_v = head.step_many(emb, feats, pos.to(dev), self.keys, self.values, visible, last)
            for b, (d, m) in enumerate(zip(drafters, need)):
                if m:
                    k_b, v_b = new_k[b, :, :m], new_v[b, :, :m]
                    d.k = k_b if d.k is None else torch.cat([d.k, k_b], dim=1)
                    d.v = v_b if d.v is None else torch.cat([d.v, v_b], dim=1)
                    d.cached, d._last = self.committed[b], out[b, -1:]
            self._append(new_k, new_v, torch.arange(M)[None, :] < torch.tensor(need)[:, None])
        self.roots = [d._last for d in drafters]

    @property
    def width(self) -> int:
        return self.seen.shape[1]

    def step(self, head: Eagle3Head, embeds, feats, pos, visible) -> torch.Tensor:
        """One tree level: ``[B, F]`` pairs (``visible`` ``[B, F, T + F]``); their keys are
        appended (seen by no row as committed). Returns ``[B, F, H]`` outputs."""
        out, k, v = head.step_many(embeds, feats, pos, self.keys, self.values, visible)
        self._append(k, v, torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool))
        return out

    def _append(self, k, v, seen) -> None:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        self.seen = torch.cat([self.seen, seen], dim=1)
