"""EAGLE-3 drafter: an autoregressive one-layer head on fused low / middle / high target features.

The head (:mod:`selfspec.drafters.eagle3_head`) keeps its own KV cache of *committed pairs*: pair t
= (fused taps of position t, embedding of token t + 1), t = 0 .. P - 1 with P = len(tokens) - 1, so
the last committed pair ends with the root and its output predicts the first draft level. The
verify pass records the taps of the accepted path (:mod:`selfspec.taps`) and the engine hands them
over in ``ctx.features``; each ``propose`` first runs those new pairs (one fused call, which also
yields the first level), then one fused call per draft level, and finally drops the tree's keys
from its cache: the cache then holds exactly the committed pairs computed from the target's own
features, as a fresh recomputation would (tested), compacted to the accepted path.

Trees (EAGLE-2, dynamic): at each level the ``branch`` most likely draft tokens of every frontier
node become candidates scored by cumulative draft log-probability; the ``width`` best candidates
form the next frontier (forwarded in one call). Point-mass trees (greedy, or ``sampled=False``)
finally keep the ``max_nodes`` best candidates overall (a node's score never exceeds its
parent's, so the kept set is a tree). With ``width = branch = 1`` this is a chain. At temperature
> 0 (``sampled``) the tree shape is fixed level by level from the draft's confidence before any
draw (the best ``width`` (parent, rank) slots within the node budget), and each chosen parent's
children are drawn without replacement from q (the target's temperature / top-k / top-p applied to
the draft logits over the full vocabulary; tokens outside the draft vocabulary have q = 0) and
recorded as ``Law.WOR`` with q, so the number of draws never depends on the draws themselves.
A greedy step whose most likely first token is under the first-token floor (``min_first``) drafts
nothing: a plain step, decided from the root's draft law alone. With a familiarity floor
(``min_familiar``) a head inside a union first *reads the prompt*: at a generation's first step it
predicts the last ``familiar_window`` committed tokens from their own pairs (teacher-forced, one
fused call and one draft LM head over the window) and, where they are among its top three less
often than the floor (random strings, a language it never saw), abstains for the whole generation
through its context key (:attr:`~selfspec.drafters.base.Drafter.abstain_key`), so the union neither
runs nor explores it there. Both decisions read committed tokens and their taps only, never a
draw: exact.
A drafter holds up to three tree configurations, chosen per step (:meth:`Eagle3Drafter.tree_config`):
its own (``cfg``), the tree of a union's merged steps (``merge_cfg``) and the tree of steps it
drafts alone at T > 0 (``sampled_cfg``, calibrated at a temperature), all run by one head.
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import asdict, dataclass, replace

import torch

from ..int8_linear import quantize_linears
from ..sampling import draw_without_replacement, target_probs
from ..tree import DraftTree, Law, TreeBuilder
from .base import DraftContext, Drafter, TargetSignature
from .dynamic_tree import pick_slots
from .eagle3_head import Eagle3Head, default_taps, draft_layer_config


HEAD_WEIGHTS = ("native", "int8")
#: A prompt's familiarity (``min_familiar``) counts the tokens the head ranks among its top this
#: many: a stored tree's first level holds up to three children; top-1 hits alone (one token in
#: six or so on English chat prompts) separated held-out chat prompts from unfamiliar text less
#: clearly (round 42).
FAMILIAR_TOP = 3
_INT8_COPIES: "weakref.WeakKeyDictionary[Eagle3Head, tuple]" = weakref.WeakKeyDictionary()  # head -> (key, copy)


@dataclass
class Eagle3Config:
    """Head shape and tree policy.

    Attributes:
        taps: target taps fused by ``fc`` (transformers ``hidden_states`` indices); default the
            inputs of layers 2, L // 2 and L - 3 (vLLM's and SGLang's default).
        draft_vocab_size: V_d, size of the reduced draft vocabulary (<= the target's).
        intermediate_size: MLP width of the draft layer (default: the target's).
        max_depth: deepest draft level.
        max_nodes: most draft nodes per step (root excluded).
        width: frontier nodes forwarded per level (1 with ``branch = 1``: a chain).
        branch: candidate tokens per frontier node.
        min_score: candidates whose path draft probability is below this are dropped.
        min_first: a greedy step whose most likely first token has draft probability (the
            head's softmax over the draft vocabulary at the root) below this drafts nothing (a
            root-only tree: a plain step, plus the catch-up and one draft LM head). The decision
            reads the root's draft law only, so it is exact. EAGLE-2's observation holds for this
            head: its first-token probability predicts greedy acceptance (round 39: on MT-Bench
            where prompt lookup had no match, steps under 0.1 accepted 0.26 draft tokens and at
            0.1-0.2 0.50, pooled about 0.43, near what a head step must accept to pay for itself
            here). Unlike ``min_score`` it never cuts deeper nodes of a confident step
            (``min_score=0.2`` cut the head's MAT on MT-Bench greedy from 2.63 to 2.15, round
            41). Steps at T > 0 ignore it: a child drawn from q is accepted with probability
            sum(min(p, q)), which the top probability does not bound (a flat q can match a flat
            p). Default 0 (off): at 0.2, measured in round 41, level on MT-Bench greedy, 0.97x
            for the head alone on BFCL, and on the adversarial prompts two runs disagreed.
        min_familiar: the familiarity floor: at a generation's first step, the share of the
            prompt's last tokens that the head, teacher-forced over the last ``familiar_window``
            pairs, ranks among its top ``FAMILIAR_TOP`` (3) draft tokens (pair t, the taps of
            position t and the embedding of token t + 1, predicts token t + 2; the window attends
            within itself) is read by :meth:`Eagle3Drafter.context_key` (a union asks it every
            step; the read runs once per generation, with the head's native weights), and under
            this floor the key is :attr:`abstain_key` until the generation ends: a union leaves
            the head out (it keeps no taps, runs no catch-up). Decided only with at least
            ``familiar_window // 4`` predicted tokens (shorter prompts count as familiar). Alone
            the head drafts as usual: it is then the only drafter, and where the target repeats
            itself its drafts can pay even on unfamiliar text (the unseen-language prompts, round
            42), which inside a union prompt lookup covers. Default 0 (off).
        familiar_window: how many of the prompt's last pairs the familiarity read runs over.
        sampled: at temperature > 0, draw children from q (else point-mass top tokens).
        head_weights: ``"native"`` drafts with the head's weights as they are; ``"int8"`` with an
            int8 weight-only copy of its linear layers (:mod:`selfspec.int8_linear`: half the
            bytes a draft call reads; drafts only, the output law stays the target's).
    """

    taps: list[int] | None = None
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None
    max_depth: int = 6
    max_nodes: int = 16
    width: int = 4
    branch: int = 4
    min_score: float = 0.0
    min_first: float = 0.0
    min_familiar: float = 0.0
    familiar_window: int = 64
    sampled: bool = True
    head_weights: str = "native"

    def __post_init__(self) -> None:
        for name in ("draft_vocab_size", "max_depth", "max_nodes", "width", "branch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.familiar_window < 8:
            raise ValueError(f"familiar_window must be >= 8, got {self.familiar_window}")
        for name in ("min_score", "min_first", "min_familiar"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.head_weights not in HEAD_WEIGHTS:
            raise ValueError(f"head_weights must be one of {HEAD_WEIGHTS}, got {self.head_weights!r}")
        if self.taps is not None and len(self.taps) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 taps, got {self.taps}")


class Eagle3Drafter(Drafter):
    """Drafts dynamic trees with an :class:`Eagle3Head` (see the module docstring)."""

    kind = "eagle3"
    guesses_first = True  # its catch-up and one draft LM head name its first token (first_guess)
    abstain_key = -1  # the prompt read unfamiliar (min_familiar): a union leaves it out this generation

    def __init__(self, model, cfg: Eagle3Config, head: Eagle3Head, signature: TargetSignature | None = None):
        super().__init__(signature or TargetSignature.of(model))
        self.model, self.cfg, self.head = model, cfg, head.eval()
        self.merge_cfg: Eagle3Config | None = None  # the tree of a union's merged steps (for_merging)
        self.sampled_cfg: Eagle3Config | None = None  # the tree of T > 0 steps drafted alone (for_sampling)
        self.embed = model.get_input_embeddings()
        self.taps = tuple(cfg.taps)
        self._draft_ids = head.draft_ids if head.draft_ids.is_meta else head.draft_ids.to("cpu")
        if cfg.head_weights != "native" and not head.fc.weight.is_meta:
            self.run_head  # built now, at load time, not inside the first timed generation
        self.reset()

    @property
    def run_head(self) -> Eagle3Head:
        """The head drafting runs: :attr:`head` itself, or (``head_weights="int8"``) an int8 copy
        of it, shared by the drafters of one head (:meth:`with_options`) and rebuilt whenever the
        head's parameters change (never stale)."""
        if self.cfg.head_weights == "native":
            return self.head
        key = tuple((p.data_ptr(), p._version) for p in self.head.parameters())
        held = _INT8_COPIES.get(self.head)
        if held is None or held[0] != key:
            runtime = copy.deepcopy(self.head)
            quantize_linears(runtime)
            held = _INT8_COPIES[self.head] = (key, runtime.eval())
        return held[1]

    def reset(self) -> None:
        self.k = self.v = None  # [kv_heads, P, d]: keys / values of the committed pairs
        self.cached = 0
        self._last = None  # [1, H] output of the last committed pair
        self._deferred: list[torch.Tensor] = []  # taps shown in skipped steps, run at the next catch-up
        self.familiar: tuple[int, int] | None = None  # (hits, predicted) of this generation's prompt read
        self._abstain: bool | None = None  # this generation's familiarity decision (None: not taken)

    def config_dict(self) -> dict:
        return asdict(self.cfg)

    def with_options(self, **options) -> "Eagle3Drafter":
        """A drafter sharing this head with other tree options (the head's shape cannot change)."""
        fixed = {"taps", "draft_vocab_size", "intermediate_size"} & set(options)
        if fixed:
            raise ValueError(f"cannot change {sorted(fixed)} of a trained eagle3 drafter")
        unknown = set(options) - set(asdict(self.cfg))
        if unknown:
            raise ValueError(f"unknown eagle3 drafter options {sorted(unknown)}")
        other = Eagle3Drafter(self.model, Eagle3Config(**(asdict(self.cfg) | options)), self.head, self.signature)
        other.checkpoint_meta = getattr(self, "checkpoint_meta", None)
        if self.merge_cfg is not None:  # (e.g. sampled=False for a union: every tree)
            other.merge_cfg = Eagle3Config(**(asdict(self.merge_cfg) | options))
        if self.sampled_cfg is not None:
            other.sampled_cfg = Eagle3Config(**(asdict(self.sampled_cfg) | options))
        return other

    def for_sampling(self, options: dict) -> "Eagle3Drafter":
        """A drafter sharing this head that drafts the tree of ``options`` in the steps it drafts
        alone at temperature > 0 (not in a union's merged steps, which keep :attr:`merge_cfg`) and
        its own tree in greedy steps. ``head_weights`` is not a tree option: given here, it
        applies to every tree (one head runs them all)."""
        other = self.with_options(**{k: v for k, v in options.items() if k == "head_weights"})
        other.sampled_cfg = self.with_options(**options).cfg
        return other

    def tree_config(self, ctx: DraftContext) -> Eagle3Config:
        """The tree options of this step: in a union's merged steps :attr:`merge_cfg` (where set,
        else :attr:`cfg`), alone :attr:`sampled_cfg` at temperature > 0 (where set), else :attr:`cfg`."""
        if ctx.merged:
            return self.merge_cfg or self.cfg
        if self.sampled_cfg is not None and not ctx.sampling.greedy:
            return self.sampled_cfg
        return self.cfg

    def for_merging(self, options: dict) -> "Eagle3Drafter":
        """A drafter sharing this head that drafts its own tree when alone and the tree of
        ``options`` in a union's merged steps (``ctx.merged``). ``head_weights`` is not a tree
        option: given here, it applies to both trees (one head runs both)."""
        other = self.with_options(**{k: v for k, v in options.items() if k == "head_weights"})
        other.merge_cfg = self.with_options(**options).cfg
        return other

    def point_mass_when_merged(self) -> "Eagle3Drafter":
        """A drafter sharing this head that samples its own tree when alone (as configured) and
        drafts point-mass children in a union's merged steps (see the base method)."""
        other = self.with_options()
        other.merge_cfg = replace(self.merge_cfg or self.cfg, sampled=False)
        return other

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor | None:
        """Run the new committed pairs; returns the last pair's ``[1, H]`` output (None if P = 0).

        ``tokens``: ``[P + 1]`` all tokens; ``features``: ``[m, 3H]`` taps of positions P-m..P-1.
        """
        committed = tokens.shape[0] - 1
        if self.cached == committed and self.cached and not self._deferred:  # (synced this step)
            return self._last
        if self._deferred:
            features = torch.cat(self._deferred + ([features] if features is not None else []))
            self._deferred = []
        m = 0 if features is None else features.shape[0]
        if self.cached + m != committed:
            raise RuntimeError(f"eagle3 drafter holds {self.cached} pairs and got {m} new features, "
                               f"but {committed} positions are committed (was a step not shown to it?)")
        if m == 0:
            return self._last
        dev, dtype = self._device_dtype()
        lo = self.cached
        head = self.run_head
        feats = head.fuse(features.to(dev, dtype))
        embeds = self.embed(tokens[lo + 1: committed + 1].to(dev)).to(dtype)
        visible = torch.ones(m, lo + m, dtype=torch.bool)
        visible[:, lo:] = torch.ones(m, m, dtype=torch.bool).tril()
        out, k, v = head.step(embeds, feats, torch.arange(lo, committed, device=dev), self.k, self.v, visible,
                              last_only=True)  # only the last pair's output is used
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        self.cached = committed
        self._last = out[-1:]
        return self._last

    def context_key(self, ctx: DraftContext) -> int:
        """:attr:`abstain_key` in a generation whose prompt the head read as unfamiliar
        (``min_familiar``), else 0 (no signal)."""
        return self.abstain_key if self.abstains(ctx) else 0

    @torch.no_grad()
    def abstains(self, ctx: DraftContext) -> bool:
        """Whether the head abstains from a union in this generation (``min_familiar``; decided
        once, at the generation's first :meth:`context_key`, from the prompt's last
        ``familiar_window`` pairs; False when first asked after the head ran)."""
        if self._abstain is None:
            floor = max(c.min_familiar for c in (self.cfg, self.merge_cfg, self.sampled_cfg) if c is not None)
            self._abstain = False
            if floor > 0 and self.cached == 0 and not self._deferred:
                self.familiar = self.read_familiarity(ctx.tokens, ctx.features, self.cfg.familiar_window)
                hits, predicted = self.familiar
                self._abstain = predicted >= self.cfg.familiar_window // 4 and hits < floor * predicted
        return self._abstain

    @torch.no_grad()
    def read_familiarity(self, tokens: torch.Tensor, features: torch.Tensor | None, window: int) -> tuple[int, int]:
        """``(hits, predicted)``: how many of the last committed tokens the head ranks among its
        top :data:`FAMILIAR_TOP` draft tokens from their own pairs, teacher-forced over the last
        ``window`` pairs in one call attending within the window. ``tokens``: ``[P + 1]``;
        ``features``: ``[m, 3H]`` taps of positions P - m .. P - 1. Pair t predicts token t + 2,
        so w pairs predict w - 1 known tokens."""
        if features is None or features.shape[0] < 2:
            return 0, 0
        w = min(window, features.shape[0])
        committed = tokens.shape[0] - 1
        dev, dtype = self._device_dtype()
        head = self.head  # (native weights: an int8 copy costs two to three times as much over 64 rows)
        positions = torch.arange(committed - w, committed, device=dev)
        feats = head.fuse(features[-w:].to(dev, dtype))
        embeds = self.embed(tokens[committed - w + 1: committed + 1].to(dev)).to(dtype)
        out, _, _ = head.step(embeds, feats, positions, None, None, torch.ones(w, w, dtype=torch.bool).tril())
        logits = head.logits(out[:-1])
        guess = self._draft_ids[logits.topk(min(FAMILIAR_TOP, logits.shape[-1]), dim=-1).indices.cpu()]
        return int((guess == tokens[committed - w + 2:, None].cpu()).any(-1).sum()), w - 1

    def skip(self, ctx: DraftContext) -> None:
        """Not drafting this step (inside a union): keep the new committed positions' taps for the
        next catch-up, which runs all of them in one call (a skipped step costs nothing). A head
        that abstains keeps nothing: no union asks it again in this generation."""
        if self._abstain:
            return
        if ctx.features is not None and ctx.features.shape[0]:
            self._deferred.append(ctx.features)

    def sync(self, ctx: DraftContext) -> None:
        """Run the committed pairs not run yet (those of skipped steps too), so that
        :meth:`propose` of this step finds its cache current."""
        self.catch_up(ctx.tokens, ctx.features)

    @torch.no_grad()
    def first_guess(self, ctx: DraftContext) -> int | None:
        """The draft vocabulary's most likely token after the root by the head (its greedy tree's
        rank-0 depth-1 child), after catching up as :meth:`sync` does: one draft LM head over the
        last committed pair's output, no draft layer call, no tree."""
        root_out = self.catch_up(ctx.tokens, ctx.features)
        if root_out is None:
            return None
        return int(self._draft_ids[int(self.run_head.logits(root_out)[0].argmax())])

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        self.last_guess = None
        root_out = self.catch_up(ctx.tokens, ctx.features)
        if root_out is None or ctx.max_depth < 1:
            return DraftTree.root_only(ctx.root_token)
        cfg = self.tree_config(ctx)
        sampled = cfg.sampled and not ctx.sampling.greedy
        try:
            return self._sampled_tree(ctx, root_out, cfg) if sampled else self._greedy_tree(ctx, root_out, cfg)
        finally:  # drop the tree's keys: the cache holds committed pairs only
            self.k, self.v = self.k[:, : self.cached], self.v[:, : self.cached]

    def _forward_level(self, head: Eagle3Head, tokens: list[int], feats: torch.Tensor, depth: int,
                       anc_slots: list[list[int]]):
        """One fused call over a frontier at ``depth`` (draft ids ``tokens``, parent outputs ``feats``
        ``[f, H]``); ``anc_slots[i]``: cache slots (after the committed pairs) of node i's forwarded
        ancestors. Appends the frontier's keys; returns its ``[f, H]`` outputs."""
        dev, dtype = self._device_dtype()
        f, base = len(tokens), self.k.shape[1]
        ids = self._draft_ids[torch.tensor(tokens)]
        visible = torch.zeros(f, base + f, dtype=torch.bool)
        visible[:, : self.cached] = True
        for i, slots in enumerate(anc_slots):
            visible[i, [self.cached + s for s in slots]] = True
            visible[i, base + i] = True
        pos = torch.full((f,), self.cached - 1 + depth, device=dev)
        out, k, v = head.step(self.embed(ids.to(dev)).to(dtype), feats, pos, self.k, self.v, visible)
        self.k, self.v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        return out

    def _greedy_tree(self, ctx: DraftContext, root_out: torch.Tensor, cfg: Eagle3Config) -> DraftTree:
        """EAGLE-2 with point-mass children: expand the best ``width`` candidates per level, keep
        the ``max_nodes`` best candidates overall by cumulative draft log-probability."""
        head = self.run_head
        cap = min(cfg.max_depth, ctx.max_depth)
        min_lp = _log(cfg.min_score)
        parent, token, score = [-1], [-1], [0.0]  # candidates; 0 is the root; token = draft id
        anc = {0: []}  # forwarded candidate -> cache slots of its forwarded ancestors and itself
        frontier, outs = [0], root_out
        for depth in range(1, cap + 1):
            logp = head.logits(outs).float().log_softmax(-1)  # [f, V_d]
            top = logp.topk(min(cfg.branch, logp.shape[-1]), dim=-1)
            if depth == 1:
                self.last_guess = int(self._draft_ids[int(top.indices[0, 0])])
                if ctx.sampling.greedy and float(top.values[0, 0]) < _log(cfg.min_first):
                    return DraftTree.root_only(ctx.root_token)  # unsure of its first token: no draft
            cand = torch.tensor([score[c] for c in frontier])[:, None] + top.values.cpu()  # [f, b]
            first, row_of = len(parent), {}
            for i, c in enumerate(frontier):
                for r in range(cand.shape[1]):
                    if float(cand[i, r]) >= min_lp:
                        row_of[len(parent)] = i
                        parent.append(c)
                        token.append(int(top.indices[i, r]))
                        score.append(float(cand[i, r]))
            if depth == cap or len(parent) == first:
                break
            nxt = sorted(sorted(range(first, len(parent)), key=lambda c: -score[c])[: cfg.width])
            base = self.k.shape[1] - self.cached
            for i, c in enumerate(nxt):
                anc[c] = anc[parent[c]] + [base + i]
            outs = self._forward_level(head, [token[c] for c in nxt], outs[[row_of[c] for c in nxt]], depth,
                                       [anc[c][:-1] for c in nxt])
            frontier = nxt
        keep = sorted(sorted(range(1, len(parent)), key=lambda c: (-score[c], c))[: cfg.max_nodes])
        builder, node = TreeBuilder(ctx.root_token), {0: 0}
        ids = self._draft_ids[torch.tensor(token[1:] or [0])].tolist()
        for c in keep:
            node[c] = builder.add(node[parent[c]], ids[c - 1])
        return builder.build()

    def _sampled_tree(self, ctx: DraftContext, root_out: torch.Tensor, cfg: Eagle3Config) -> DraftTree:
        """Children drawn without replacement from q; the shape is fixed from q before any draw."""
        head = self.run_head
        cap = min(cfg.max_depth, ctx.max_depth)
        vocab = self.signature.vocab_size
        builder = TreeBuilder(ctx.root_token)
        level, scores, anc, par, outs = [0], {0: 1.0}, {0: []}, {}, root_out
        for depth in range(1, cap + 1):
            logits = head.logits(outs).float()  # [f, V_d]
            conf = logits.softmax(-1)
            top = conf.topk(min(cfg.branch, conf.shape[-1]), dim=-1)
            if depth == 1:  # (the most likely first token, whatever the draws)
                self.last_guess = int(self._draft_ids[int(top.indices[0, 0])])
            room = min(cfg.width, cfg.max_nodes + 1 - len(builder))
            chosen = pick_slots(torch.tensor([scores[n] for n in level]), top.values.cpu(), room, cfg.min_score)
            if not chosen:
                break
            new, rows, draft_tokens = [], [], []
            for j, ranks in chosen.items():
                full = torch.full((vocab,), -float("inf"), dtype=logits.dtype)
                full[self._draft_ids] = logits[j].cpu()
                q = target_probs(full, ctx.sampling)
                builder.set_draft_probs(level[j], q)
                count = min(len(ranks), int((q > 0).sum()))
                for t in draw_without_replacement(q, count, ctx.generator):
                    d = int(self._t2d_index[t])
                    node = builder.add(level[j], t, Law.WOR)
                    par[node] = level[j]
                    scores[node] = scores[level[j]] * float(conf[j, d])
                    new.append(node)
                    rows.append(j)
                    draft_tokens.append(d)
            if depth == cap or len(builder) > cfg.max_nodes:
                break
            base = self.k.shape[1] - self.cached
            for i, n in enumerate(new):
                anc[n] = anc[par[n]] + [base + i]
            outs = self._forward_level(head, draft_tokens, outs[rows], depth, [anc[n][:-1] for n in new])
            level = new
        return builder.build()

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
    """``build_drafter(model, "eagle3", ...)``: an untrained head whose draft vocabulary is the first
    ``draft_vocab_size`` token ids (training picks the most frequent ones)."""
    cfg = Eagle3Config(**options)
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
    return Eagle3Drafter(model, cfg, head.to(param.device, param.dtype))


def eagle3_weights(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The head's tensors under the ``eagle3.`` prefix (d2t / t2d included)."""
    return {f"eagle3.{k}": v for k, v in drafter.head.state_dict().items()}


def eagle3_from_checkpoint(model, meta: dict, weights: dict[str, torch.Tensor]) -> Eagle3Drafter:
    """Rebuild the drafter from a checkpoint already checked against ``model``."""
    from ..checkpoint import adapter_state  # checkpoint imports the drafters package

    try:
        cfg = Eagle3Config(**meta["config"])
    except (KeyError, TypeError) as err:
        raise ValueError(f"eagle3 checkpoint config is invalid: {err}") from None
    drafter = build_eagle3(model, **asdict(cfg))
    state = adapter_state(weights, "eagle3.", drafter.head.state_dict())
    drafter.head.load_state_dict({k: v.to(drafter.head.state_dict()[k].dtype) for k, v in state.items()})
    drafter._draft_ids = drafter.head.draft_ids.to("cpu")
    return drafter


def _log(p: float) -> float:
    """``log(p)``, ``-inf`` for ``p = 0`` (no floor)."""
    return math.log(p) if p > 0 else -math.inf
