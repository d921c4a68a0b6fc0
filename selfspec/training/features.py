"""Frozen-target features for training drafters on self-distilled conversations.

The target is frozen, so its last hidden states are computed once per example and cached
(``FeatureCache``) instead of once per epoch. Row ``g`` of ``hidden`` is the post-norm hidden state
at one position of one example; ``positions`` lists the rows ``t`` a drafter is trained at: from
the last prompt token to the end, i.e. every position whose next token was written by the target.
``labels[i, k]`` is the token ``k + 2`` positions after ``positions[i]`` (what head k+1 must
guess; ``-100`` where it falls outside the example or inside the prompt). The target's own next
token law at row ``g + k`` is what head k+1 would ideally match (used by the KL loss).

:func:`batch_features` computes the same layout for a few examples in one padded target pass: the
online mode of the Medusa and layer-skip recipes, where nothing is cached on disk.

Layer-skip drafters are trained on ``exit_hidden``: the output of layer E-1 (before the final norm)
at the same rows, with ``first = 1`` (label = the very next token, target law at the same row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

IGNORE = -100


@dataclass
class FeatureCache:
    """Attributes (N training positions, T cached rows, K heads):

    hidden: ``[T, H]`` cached last hidden states (float32 or bfloat16, CPU), per example the rows
        from its last prompt token to its end.
    exit_hidden: ``[T, H]`` outputs of the first E layers at the same rows, or ``None``.
    positions: ``[N]`` rows of ``hidden`` that training reads.
    labels: ``[N, K]`` target tokens per head, ``IGNORE`` where undefined.
    example: ``[N]`` example index of each position (for splits).
    """

    hidden: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    example: torch.Tensor
    exit_hidden: torch.Tensor | None = None

    def subset(self, mask: torch.Tensor) -> "FeatureCache":
        return FeatureCache(self.hidden, self.positions[mask], self.labels[mask], self.example[mask], self.exit_hidden)


def head_labels(tokens: torch.Tensor, prompt_len: int, num_heads: int, first: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and labels of one example.

    Args:
        tokens: ``[L]`` prompt followed by the target's response.
        prompt_len: number of prompt tokens (>= 1).
        num_heads: K.
        first: offset of head 1's label (2 for Medusa heads, 1 for a next-token drafter).

    Returns:
        ``(positions [n], labels [n, K])`` with ``positions = prompt_len - 1 .. L - 2``.
    """
    length = tokens.shape[0]
    positions = torch.arange(prompt_len - 1, length - 1)
    labels = torch.full((positions.shape[0], num_heads), IGNORE, dtype=torch.long)
    for k in range(num_heads):
        src = positions + k + first  # head k+1 at position t guesses token t + k + first
        ok = src < length
        labels[ok, k] = tokens[src[ok]]
    return positions, labels


@torch.no_grad()
def build_features(model, dataset, num_heads: int, *, max_len: int = 1024, dtype=torch.float32,
                   progress: bool = True, exit_layer: int | None = None, first: int = 2) -> FeatureCache:
    """Run the frozen target once over every example and collect positions and labels (and the
    first ``exit_layer`` layers' outputs when given, through the same split inference uses)."""
    from selfspec.model.layer_slice import LayerSlice, num_layers

    decoder = model.get_decoder()
    if exit_layer is not None:
        lower = LayerSlice(model, range(exit_layer), final_norm=False)
        upper = LayerSlice(model, range(exit_layer, num_layers(model)))
    exits = []
    device = next(model.parameters()).device
    hidden, positions, labels, example = [], [], [], []
    offset = 0
    for i, row in enumerate(tqdm(dataset, desc="target features", disable=not progress, unit="example")):
        prompt, response = row["prompt_ids"], row["response_ids"]
        tokens = torch.tensor((prompt + response)[:max_len], dtype=torch.long)
        if len(response) == 0 or len(prompt) >= tokens.shape[0]:
            continue
        start = len(prompt) - 1  # rows before the last prompt token are never read
        if exit_layer is None:
            h = decoder(input_ids=tokens[None].to(device)).last_hidden_state[0, start:]
        else:
            low = lower(input_ids=tokens[None].to(device))
            h = upper(inputs_embeds=low)[0, start:]
            exits.append(low[0, start:].to("cpu", dtype))
        pos, lab = head_labels(tokens, len(prompt), num_heads, first)
        hidden.append(h.to("cpu", dtype))
        positions.append(pos - start + offset)
        labels.append(lab)
        example.append(torch.full_like(pos, i))
        offset += h.shape[0]
    return FeatureCache(torch.cat(hidden), torch.cat(positions), torch.cat(labels), torch.cat(example),
                        torch.cat(exits) if exits else None)


@torch.no_grad()
def batch_features(model, examples, num_heads: int, *, max_len: int = 1024, dtype=torch.float32,
                   exit_layer: int | None = None, first: int = 2) -> FeatureCache:
    """:func:`build_features` for a list of examples in ONE right-padded target pass (online
    training). Causal attention makes the padding invisible to the real positions, so the result
    equals :func:`build_features` up to float summation order (tested); ``example`` numbers the
    examples in the given order."""
    from selfspec.model.layer_slice import LayerSlice, num_layers

    device = next(model.parameters()).device
    kept = [(e["prompt_ids"], (e["prompt_ids"] + e["response_ids"])[:max_len]) for e in examples]
    kept = [(i, p, t) for i, (p, t) in enumerate(kept) if len(t) > len(p) >= 1]
    if not kept:
        raise ValueError("none of these examples has a response token within max_len")
    ids = torch.zeros(len(kept), max(len(t) for _, _, t in kept), dtype=torch.long)
    for b, (_, _, t) in enumerate(kept):
        ids[b, :len(t)] = torch.tensor(t)
    if exit_layer is None:
        last, low = model.get_decoder()(input_ids=ids.to(device)).last_hidden_state, None
    else:
        low = LayerSlice(model, range(exit_layer), final_norm=False)(input_ids=ids.to(device))
        last = LayerSlice(model, range(exit_layer, num_layers(model)))(inputs_embeds=low)
    hidden, exits, positions, labels, example = [], [], [], [], []
    offset = 0
    for b, (i, prompt, tokens) in enumerate(kept):
        tokens = torch.tensor(tokens, dtype=torch.long)
        start = len(prompt) - 1
        hidden.append(last[b, start:len(tokens)].to("cpu", dtype))
        if low is not None:
            exits.append(low[b, start:len(tokens)].to("cpu", dtype))
        pos, lab = head_labels(tokens, len(prompt), num_heads, first)
        positions.append(pos - start + offset)
        labels.append(lab)
        example.append(torch.full_like(pos, i))
        offset += hidden[-1].shape[0]
    return FeatureCache(torch.cat(hidden), torch.cat(positions), torch.cat(labels), torch.cat(example),
                        torch.cat(exits) if exits else None)


def label_counts(examples, num_heads: int, max_len: int, first: int = 2) -> torch.Tensor:
    """``[K]`` valid labels per head over ``examples``, from their token ids alone (no target)."""
    total = torch.zeros(num_heads, dtype=torch.long)
    for e in examples:
        tokens = torch.tensor((e["prompt_ids"] + e["response_ids"])[:max_len], dtype=torch.long)
        if len(tokens) > len(e["prompt_ids"]) >= 1:
            total += (head_labels(tokens, len(e["prompt_ids"]), num_heads, first)[1] != IGNORE).sum(0)
    return total
