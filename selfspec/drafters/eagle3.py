"""EAGLE-3 drafter: an autoregressive one-layer head on fused low / middle / high target features.

The head (:mod:`selfspec.drafters.eagle3_head`) keeps its own KV cache of *committed pairs*: pair t
= (fused taps of position t, embedding of token t + 1), t = 0 .. P - 1 with P = len(tokens) - 1, so
the last committed pair ends with the root and its output predicts the first draft level. The
verify pass records the taps of every committed position (:mod:`selfspec.taps`), which the engine
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

from ..int8_linear import quantize_linears
from ..tree import DraftTree
from .base import DraftContext, Drafter, Requirements, TargetSignature
from .registry import register
from .eagle3_head import Eagle3Head, default_taps, draft_layer_config
from .expander import TreePolicy, expand

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
    (:mod:`selfspec.int8_linear`: half the bytes a draft call reads; drafts only); ``"auto"``:
    int8 where the head runs in bf16 on a CPU whose int8 kernel passes its check, else native (a
    draft step 14.9 ms against 20.1 with the unpacked bf16 head, ``docs/results/r15_head_kernels.md``)."""

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
    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor | None:
        """Run the committed pairs not run yet; returns the last pair's ``[1, H]`` output (None if
        P = 0). ``tokens``: ``[P + 1]`` all tokens; ``features``: ``[P, 3H]`` taps of every
        committed position."""
        committed = tokens.shape[0] - 1
        if self.cached > committed:
            raise RuntimeError(f"eagle3 drafter holds {self.cached} pairs but only {committed} positions are "
                               "committed (a new generation without reset?)")
        if self.cached == committed:
            return self._last
        if features is None or features.shape[0] < committed:
            raise RuntimeError(f"eagle3 drafter needs the taps of all {committed} committed positions, got "
                               f"{0 if features is None else features.shape[0]}")
        dev, dtype = self._device_dtype()
        lo, m = self.cached, committed - self.cached
        head = self.run_head
        feats = head.fuse(features[lo:committed].to(dev, dtype))
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

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        root_out = self.catch_up(ctx.tokens, ctx.features)
        if root_out is None or ctx.max_depth < 1:
            return DraftTree.root_only(ctx.root_token)
        head = self.run_head
        slots: dict[int, int] = {}  # forwarded node -> its cache slot after the committed pairs

        def forward(builder, nodes, rows, depth):
            nonlocal outs
            dev, dtype = self._device_dtype()
            f, base = len(nodes), self.k.shape[1]
            visible = torch.zeros(f, base + f, dtype=torch.bool)
            visible[:, : self.cached] = True
            for i, node in enumerate(nodes):
                up = builder.parent(node)
                while up > 0:
                    visible[i, self.cached + slots[up]] = True
                    up = builder.parent(up)
                visible[i, base + i] = True
            for i, node in enumerate(nodes):
                slots[node] = base - self.cached + i
            ids = torch.tensor([builder.token(n) for n in nodes])
            pos = torch.full((f,), self.cached - 1 + depth, device=dev)
            out, k, v = head.step(self.embed(ids.to(dev)).to(dtype), outs[rows], pos, self.k, self.v, visible)
            self.k, self.v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
            outs = out
            return head.logits(out)

        outs = root_out
        try:
            tree, _ = expand(ctx, self.policy, head.logits(root_out), forward, vocab=self.signature.vocab_size,
                             draft_ids=self._draft_ids, t2d=self._t2d_index)
            return tree
        finally:  # drop the tree's keys: the cache holds committed pairs only
            self.k, self.v = self.k[:, : self.cached], self.v[:, : self.cached]

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
