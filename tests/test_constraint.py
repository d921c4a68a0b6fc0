"""Constrained decoding stays exact under speculation: with a token mask that depends on the path,
speculative output has the law of constrained plain decoding (chi-square on the enumerated law,
every child law, with top-k / top-p), greedy is identical, and a negative control (the root's mask
reused for every node) fails the same test."""

from __future__ import annotations

import itertools

import pytest
import torch

from selfspec.decoding.constraint import Constraint
from stubs import decode
from selfspec.decoding.sampling import SamplingConfig, target_probs
from selfspec.decoding.tree import Law
from stubs import ScriptedDrafter, fixed, table_target
from test_distribution import chi_square_ok, control_samples

VOCAB, PROMPT, NEW = 6, [1, 2], 3


def allowed_after(output: list[int]) -> torch.Tensor:
    """Token 0 never comes first; after token t, t + 1 (mod V) and t + 3 are forbidden."""
    mask = torch.ones(VOCAB, dtype=torch.bool)
    if not output:
        mask[0] = False
    else:
        mask[(output[-1] + 1) % VOCAB] = False
        mask[(output[-1] + 3) % VOCAB] = False
    return mask


# row t: the mask after a path ending in token t; row VOCAB: the mask of an empty output
TABLE = torch.stack([allowed_after([t]) for t in range(VOCAB)] + [allowed_after([])])


class PathConstraint(Constraint):
    """The mask of each node's own path (it depends on the path's last token only)."""

    def masks(self, output, tree, vocab):
        last = tree.tokens.clone()
        last[0] = output[-1] if output else VOCAB  # the root: the last generated token, if any
        return TABLE[last]


class RootMaskEverywhere(PathConstraint):
    """Lossy: every node gets the root's mask (a constraint applied once per step, not per node)."""

    def masks(self, output, tree, vocab):
        return TABLE[output[-1] if output else VOCAB][None].expand(tree.num_nodes, -1).clone()


def constrained_law(cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    target, law = table_target(VOCAB), {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        ctx, out, prob = list(PROMPT), [], 1.0
        for tok in seq:
            logits = target.logits_after(ctx).masked_fill(~allowed_after(out), float("-inf"))
            prob *= float(target_probs(logits, cfg)[tok])
            ctx.append(tok)
            out.append(tok)
        if prob > 0:
            law[seq] = prob
    return law


def draw(cfg, drafter, constraint, n: int = 20000, seed: int = 0) -> dict[tuple[int, ...], int]:
    target, gen, counts = table_target(VOCAB), torch.Generator().manual_seed(seed), {}
    ids, controller = torch.tensor(PROMPT), fixed(drafter)
    for _ in range(n):
        out = decode(target, ids, controller, cfg, gen, NEW, set(), 100, constraint=constraint)
        key = tuple(out.sequences[0, len(PROMPT):].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("cfg,draft", [
    (SamplingConfig(1.0), dict(point=2, sampled=0)),
    (SamplingConfig(0.7, top_k=3), dict(point=1, sampled=2, law=Law.WOR)),
    (SamplingConfig(1.3, top_p=0.8), dict(point=0, sampled=3, law=Law.IID)),
])
def test_speculative_law_equals_constrained_plain_law(cfg, draft):
    law = constrained_law(cfg)
    assert all(s[0] != 0 and (s[0] + 1) % VOCAB != s[1] for s in law)  # the constraint bites
    ok, msg = chi_square_ok(law, draw(cfg, ScriptedDrafter(VOCAB, **draft), PathConstraint()))
    assert ok, msg
    if cfg.top_k == 0 and cfg.top_p == 1.0:  # once: constrained plain decoding itself has this law
        plain_ok, plain_msg = chi_square_ok(law, draw(cfg, None, PathConstraint(), n=10000), n=10000)
        assert plain_ok, plain_msg


def test_negative_control_root_mask_on_every_node_fails():
    cfg, n = SamplingConfig(1.0), control_samples(20000)
    ok, msg = chi_square_ok(constrained_law(cfg), draw(cfg, ScriptedDrafter(VOCAB, point=2, sampled=2),
                                                       RootMaskEverywhere(), n=n), n=n)
    assert not ok, f"the lossy constraint passed ({msg}): the test is vacuous"


def test_greedy_identity_with_constraint():
    cfg = SamplingConfig(0.0)
    plain = decode(table_target(VOCAB), torch.tensor(PROMPT), None, cfg, torch.Generator(), 40, set(), 100,
                   constraint=PathConstraint())
    out = plain.sequences[0, len(PROMPT):].tolist()
    assert all(allowed_after(out[:i])[t] for i, t in enumerate(out))
    spec = decode(table_target(VOCAB), torch.tensor(PROMPT), fixed(ScriptedDrafter(VOCAB, point=3, sampled=0)), cfg,
                  torch.Generator(), 40, set(), 100, constraint=PathConstraint())
    assert spec.sequences.tolist() == plain.sequences.tolist()
    free = decode(table_target(VOCAB), torch.tensor(PROMPT), None, cfg, torch.Generator(), 40, set(), 100)
    assert free.sequences.tolist() != plain.sequences.tolist()  # unconstrained greedy differs
