"""The EAGLE-3 draft head: one decoder layer on fused multi-layer target features.

Notation: the target has L layers and hidden size H; ``taps`` are indices into transformers'
``hidden_states`` numbering (``hidden_states[k]`` = the input of layer k, ``k = L`` the last
layer's output before the final norm). The head's parameters are named exactly as the EAGLE-3
serving layout that vLLM (``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM``) and SGLang load:

* ``fc``: ``[H, 3H]``, fuses the three taps of a committed position into one feature. Targets'
  residual streams are large (SmolLM2: RMS ~170 in its middle layers, up to 2.5e4 at the first
  position), which makes a raw ``fc`` untrainable with Adam; training therefore reads the taps
  divided by a fixed per-channel ``tap_scale`` (their measured RMS). It is a reparameterisation
  only: the export folds it into ``fc.weight``, so engines see the plain ``fc`` of the layout;
* ``midlayer``: one llama-style decoder layer whose attention reads
  ``[input_layernorm(embedding); hidden_norm(feature)]`` (width 2H) and whose residual is the raw
  feature (``norm_before_residual = False``): ``h = o_proj(attn) + feature``,
  ``out = mlp(post_attention_layernorm(h)) + h``;
* ``norm`` then ``lm_head`` ``[V_d, H]`` over a reduced draft vocabulary; ``d2t`` ``[V_d]`` int64
  offsets (draft id i is target id ``i + d2t[i]``) and ``t2d`` ``[V]`` bool (in the draft vocab).

The token embedding is the target's own (frozen, not stored). ``out`` (pre-norm) is the feature of
the next draft step. A draft *pair* at position t is (feature of position t, embedding of token
t + 1); its output predicts token t + 2. Rotary positions follow the target's convention (its
``rope_parameters``); the layer is built from transformers' llama parts (``LlamaRMSNorm``,
``LlamaMLP``, ``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``). Only the 2H-wide attention
input and the training-time-test attention pattern below are written here: no transformers class
has them.

Training-time test (:meth:`Eagle3Head.ttt_forward`): the head is unrolled K steps over a whole
sequence as at inference. Step 0 reads the target's features with causal attention; step j >= 1
at chain t reads step j-1's output at t and token t + j + 1, sits at position t + j, and attends
to step 0's keys at positions <= t plus its own chain's keys of steps 1..j (the tree path). Its
output predicts token t + j + 2. :meth:`step` is the inference form of the same computation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb, rotate_half)


def default_taps(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high taps, the default of vLLM and SGLang: inputs of layers
    2, L // 2 and L - 3."""
    if num_layers < 4:
        return [1, max(1, num_layers // 2), num_layers]
    return [2, num_layers // 2, num_layers - 3]


def draft_layer_config(model, intermediate_size: int | None = None) -> LlamaConfig:
    """The draft layer's llama config, built from the target's dimensions and rotary convention
    (also the ``config.json`` the EAGLE-3 export writes)."""
    cfg = model.config.get_text_config(decoder=True)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    if "full_attention" in rope:  # per-layer-type rotary (Gemma 3): the global layers' convention
        rope = rope["full_attention"]
    act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu"
    return LlamaConfig(
        vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
        intermediate_size=int(intermediate_size or cfg.intermediate_size), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=int(getattr(cfg, "num_key_value_heads", heads) or heads),
        head_dim=head_dim, hidden_act=act, rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 8192) or 8192),
        rope_parameters=dict(rope), attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
    )


class Eagle3Attention(nn.Module):
    """q/k/v read the 2H-wide ``[norm(embedding); norm(feature)]``; o_proj writes H."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, self.heads, self.kv_heads, self.head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``[B, n, 2H]`` -> q ``[B, heads, n, d]``, k / v ``[B, kv_heads, n, d]`` (rotary applied)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The queries of :meth:`qkv` alone: ``[B, heads, n, d]``."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        return q * cos[:, None] + rotate_half(q) * sin[:, None]

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of :meth:`qkv` alone: ``[B, kv_heads, n, d]`` each."""
        b, n, _ = x.shape
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return k * cos[:, None] + rotate_half(k) * sin[:, None], v


class Eagle3Layer(nn.Module):
    """The EAGLE-3 mid layer (see the module docstring)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(cfg)

    def attn_input(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``[B, n, H]`` embeddings and features -> ``[B, n, 2H]`` attention input."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(feats)], dim=-1)

    def qkv(self, embeds, feats, cos, sin):
        return self.self_attn.qkv(self.attn_input(embeds, feats), cos, sin)

    def finish(self, attn: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``attn`` ``[B, heads, n, d]`` attention output, ``feats`` ``[B, n, H]`` the residual."""
        b, _, n, _ = attn.shape
        h = self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, -1)) + feats
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Head(nn.Module):
    """fc + mid layer + norm + reduced-vocabulary LM head (parameter names = the serving layout)."""

    def __init__(self, cfg: LlamaConfig, draft_vocab_size: int, num_taps: int = 3, target_hidden: int | None = None):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(num_taps * (target_hidden or h), h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("tap_scale", torch.ones(num_taps * (target_hidden or h)))
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.__dict__["_inv_freq32"] = self.rotary.inv_freq.detach().clone()  # not a buffer: never cast

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Use the increasing target ids ``draft_ids`` ``[V_d]`` as the draft vocabulary."""
        ids = draft_ids.to(self.d2t.device, torch.long)
        if ids.is_meta:  # shapes only (a dry run's estimate): nothing to check or fill
            return
        if ids.shape != self.d2t.shape or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"draft ids must be {self.d2t.shape[0]} increasing target ids")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.t2d.shape[0]:
            raise ValueError(f"draft ids must lie in [0, {self.t2d.shape[0]})")
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def _apply(self, fn, *args, **kwargs):
        """Casting the head keeps the rotary frequencies in float32 (as the engines compute them)."""
        out = super()._apply(fn, *args, **kwargs)
        rot = self.rotary
        if rot.inv_freq.dtype != torch.float32:
            rot.inv_freq = self.__dict__["_inv_freq32"].to(rot.inv_freq.device)
            rot.original_inv_freq = rot.inv_freq.clone()
        return out

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """``[..., 3H]`` taps -> ``[..., H]`` features: ``fc(taps / tap_scale)``."""
        return self.fc(taps / self.tap_scale.to(taps.dtype))

    def folded_fc_weight(self) -> torch.Tensor:
        """``fc.weight`` with ``tap_scale`` folded in: ``fuse(x) == x @ folded.T`` (export layout)."""
        return self.fc.weight / self.tap_scale.to(self.fc.weight.dtype)[None, :]

    @property
    def draft_ids(self) -> torch.Tensor:
        """``[V_d]`` target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.shape[0], device=self.d2t.device)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` pre-norm outputs -> ``[..., V_d]`` draft logits."""
        return self.lm_head(self.norm(out))

    def step(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor | None,
             past_v: torch.Tensor | None, visible: torch.Tensor, last_only: bool = False):
        """One fused draft call over n pairs of one sequence (:meth:`step_many` with one row).

        Args:
            embeds / feats: ``[n, H]`` token embeddings and features of the pairs.
            positions: ``[n]`` rotary positions.
            past_k / past_v: ``[kv_heads, S, d]`` cached keys / values (or ``None`` when S = 0).
            visible: ``[n, S + n]`` bool, which cached and new keys each pair attends to.
            last_only: compute the output of the last pair only (``out`` ``[1, H]``); keys and
                values are still those of all n pairs. A catch-up over committed pairs needs no
                other output (only the last one feeds the next draft step), and the query, the
                attention, ``o_proj`` and the MLP of the other n - 1 rows are then never run:
                over a prompt, about 60% of the layer's work. Row by row the same math as the
                full call (in low precision a one-row matmul may round differently).

        Returns:
            ``(out [n, H], k [kv_heads, n, d], v [kv_heads, n, d])``: pre-norm outputs and the new keys
            and values, in the order of the pairs.
        """
        last = torch.tensor([embeds.shape[0] - 1], device=embeds.device) if last_only else None
        out, k, v = self.step_many(embeds[None], feats[None], positions[None],
                                   None if past_k is None else past_k[None], None if past_v is None else past_v[None],
                                   visible[None], last)
        return out[0], k[0], v[0]

    def step_many(self, embeds: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                  past_k: torch.Tensor | None, past_v: torch.Tensor | None, visible: torch.Tensor,
                  last: torch.Tensor | None = None):
        """One fused draft call over B rows of n pairs each (a row with fewer pairs is padded with
        pairs that only see themselves and that no real pair sees; their outputs are not read).

        Args:
            embeds / feats: ``[B, n, H]``; positions: ``[B, n]`` rotary positions.
            past_k / past_v: ``[B, kv_heads, S, d]`` (rows' caches side by side, holes hidden by
                ``visible``) or ``None`` (S = 0).
            visible: ``[B, n, S + n]`` bool, which cached and new keys each pair attends to.
            last: ``[B]`` long: compute only the output of pair ``last[b]`` of each row (see
                :meth:`step`'s ``last_only``); ``None``: every pair's.

        Returns:
            ``(out [B, n or 1, H], k [B, kv_heads, n, d], v [B, kv_heads, n, d])``.
        """
        cos, sin = self.rotary(feats, positions)
        x = self.midlayer.attn_input(embeds, feats)
        attn_mod = self.midlayer.self_attn
        if last is not None:
            k, v = attn_mod.kv(x, cos, sin)
            pick = last.to(x.device)[:, None, None]

            def row(t):
                return t.gather(1, pick.expand(-1, 1, t.shape[-1]))

            q = attn_mod.q(row(x), row(cos), row(sin))
            visible, feats = row(visible.to(x.device)), row(feats)
        else:
            q, k, v = attn_mod.qkv(x, cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None].to(q.device),
                                              enable_gqa=True)
        return self.midlayer.finish(attn, feats), k, v

    def forward(self, taps: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training: the K steps' draft logits ``[B, T, V_d]`` (see :meth:`ttt_forward`)."""
        return [self.logits(out) for out in self.ttt_forward(taps, embeds, steps)]

    def ttt_forward(self, taps: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over a right-padded batch.

        Args:
            taps: ``[B, T, 3H]`` target features of positions 0..T-1.
            embeds: ``[B, T, H]`` embeddings of tokens 0..T-1.
            steps: K unrolled steps.

        Returns:
            K tensors ``[B, T, H]``: step j's pre-norm output at chain t (predicts token t + j + 2;
            rows whose inputs fall past the sequence are garbage and must be masked by the caller).
        """
        b, t_len, _ = embeds.shape
        feats = self.fuse(taps)
        pos = torch.arange(t_len, device=embeds.device)
        causal = torch.ones(t_len, t_len, dtype=torch.bool, device=embeds.device).tril()
        attn_mod = self.midlayer.self_attn
        group = attn_mod.heads // attn_mod.kv_heads
        scale = 1.0 / math.sqrt(attn_mod.head_dim)
        keys, values, outs = [], [], []
        for j in range(steps):
            e = torch.cat([embeds[:, j + 1:], embeds[:, -1:].expand(b, min(j + 1, t_len), -1)], dim=1)[:, :t_len]
            cos, sin = self.rotary(feats, (pos + j)[None].expand(b, -1))
            q, k, v = self.midlayer.qkv(e, feats, cos, sin)  # q [B, h, T, d]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            keys.append(k)
            values.append(v)
            s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
            s0 = s0.masked_fill(~causal, torch.finfo(s0.dtype).min)
            diag = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # [B, h, T, 1] each
            scores = torch.cat([s0] + diag, dim=-1)
            p = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
            attn = p[..., :t_len] @ values[0]
            for i in range(1, j + 1):
                attn = attn + p[..., t_len + i - 1: t_len + i] * values[i]
            out = self.midlayer.finish(attn, feats)
            outs.append(out)
            feats = out
        return outs
