"""The model drafters' sampling at the batched harness's power (N = 2e5).

EAGLE-3 and layer-skip drafters (block, none and LoRA adapters) sample their children in one place:
the shared level-wise expander (:func:`selfspec.drafters.expander.expand`), fed the drafter's
logits level by level. Their output law rests on three things, each tested at its own power:

* the expander draws each parent's children from the ``q`` it records (with the law it records),
  for full and reduced draft vocabularies, with or without a node budget: here, the *real*
  ``expand`` per walker with a table-driven ``forward`` (logits a fixed random function of the node
  and its parent, as a model's are of its context), every walker's tree verified by the engine's
  verifier, N = 2e5 generations of the exact-table target (test_distribution's harness: a law
  1.4% off in total variation fails with probability >= 0.9);
* each real drafter's children reach the verifier with exactly the law they were drawn from
  (bitwise, every sampled parent of every step: :func:`test_real_drafters_record_the_law_they_draw_from`,
  EAGLE-3 with native and int8 weights, layer-skip with the block and LoRA adapters);
* the verifier (test_distribution at 2e5 / 1e6) and the engine loop end to end with each real
  drafter (the decode-loop law tests of test_eagle3, test_layerskip and test_lora_skip, 6,000-8,000
  samples).

N: ``SELFSPEC_LAW_SAMPLES`` (default 2e4, 4.4% total variation, so the suite stays within minutes;
a walker costs about a millisecond of Python here). At N = 2e5 both cases pass and both controls
fail at N / 4 (``SELFSPEC_LAW_SAMPLES=200000 pytest tests/test_expander_law.py``, 14.5 minutes on
this 2-core CPU; docs/exactness.md).

Negative controls: an expander that records a law other than the one it draws from, and one that
draws with replacement while recording ``WOR``; both must fail the same test.
"""

from __future__ import annotations

import os

import pytest
import torch

import selfspec
import selfspec.decoding.verify as verify_mod
from selfspec.drafters import build_drafter

import selfspec.drafters.expander as expander_mod
from selfspec.drafters.base import DraftContext
from selfspec.drafters.expander import TreePolicy, expand
from selfspec.decoding.sampling import SamplingConfig, target_probs
from selfspec.decoding.tree import DraftTree
from selfspec.decoding.verify import TreeBatch, verify_batch
from stubs import table_target
from test_distribution import NEW, PROMPT, VOCAB, chi_square_ok, control_samples, exact_law

LAW_SAMPLES = int(os.environ.get("SELFSPEC_LAW_SAMPLES", 20_000))


class TableDrafter:
    """Draft logits ``[V_d]`` of a node: a fixed random function of (its parent's token, its token).
    ``draft_ids``: the target id of each draft id (a reduced draft vocabulary), or ``None``."""

    def __init__(self, draft_ids: list[int] | None = None, seed: int = 7):
        self.draft_ids = None if draft_ids is None else torch.tensor(draft_ids)
        self.t2d = None
        size = VOCAB
        if draft_ids is not None:
            self.t2d = torch.full((VOCAB,), -1, dtype=torch.long)
            self.t2d[self.draft_ids] = torch.arange(len(draft_ids))
            size = len(draft_ids)
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(VOCAB, VOCAB, size, generator=g, dtype=torch.float64) * 1.5

    def propose(self, prev: int, root: int, cfg: SamplingConfig, gen: torch.Generator, policy: TreePolicy,
                max_nodes: int | None) -> DraftTree:
        ctx = DraftContext(tokens=torch.tensor([prev, root]), root_hidden=None, max_depth=NEW - 1, sampling=cfg,
                           generator=gen, max_nodes=max_nodes)

        def forward(builder, nodes, rows, depth):
            return torch.stack([self.table[builder.token(builder.parent(n)), builder.token(n)] for n in nodes])

        tree, _ = expand(ctx, policy, self.table[prev, root][None], forward, vocab=VOCAB, draft_ids=self.draft_ids,
                         t2d=self.t2d)
        return tree


def tree_counts(cfg: SamplingConfig, drafter: TableDrafter, n: int, policy: TreePolicy,
                max_nodes: int | None = None, seed: int = 0) -> dict[tuple[int, ...], int]:
    """Counts of the first NEW tokens of ``n`` generations: each round, every walker's tree from
    the expander; trees grouped by shape and verified together by :func:`verify_batch`."""
    table = target_probs(table_target(VOCAB).table, cfg)  # [V, V, V]: the law after every 2-token prefix
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(PROMPT[-2:]) for _ in range(n)]
    active = list(range(n))
    while active:
        groups: dict[tuple, list[tuple[int, DraftTree]]] = {}
        for w in active:
            s = seqs[w]
            tree = drafter.propose(s[-2], s[-1], cfg, gen, policy, max_nodes)
            key = (tuple(tree.parents.tolist()), tuple(tree.laws.tolist()), tuple(tree.draft_row.tolist()))
            groups.setdefault(key, []).append((w, tree))
        for members in groups.values():
            shape = members[0][1]
            tokens = torch.stack([t.tokens for _, t in members])
            draft = None if shape.draft_probs is None else torch.stack([t.draft_probs for _, t in members])
            before = torch.empty_like(tokens)
            before[:, 0] = torch.tensor([seqs[w][-2] for w, _ in members])
            for i in range(1, shape.num_nodes):
                before[:, i] = tokens[:, int(shape.parents[i])]
            last, nxt, _ = verify_batch(TreeBatch(shape, tokens, draft), table[before, tokens], gen)
            for (w, _), row, node, token in zip(members, tokens.tolist(), last.tolist(), nxt.tolist()):
                seqs[w] += [row[i] for i in shape.path_to(node)[1:]] + [token]
        active = [w for w in active if len(seqs[w]) < 2 + NEW]
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        key = tuple(s[2: 2 + NEW])
        counts[key] = counts.get(key, 0) + 1
    return counts


CASES = {
    "full vocab, T0.9 top-k 4": (SamplingConfig(0.9, top_k=4), None, None),
    "reduced vocab, T1.2 top-p 0.9, budget 3": (SamplingConfig(1.2, top_p=0.9), [0, 2, 3, 5], 3),
}
POLICY = TreePolicy(max_depth=NEW - 1, width=3, branch=3)


@pytest.mark.parametrize("case", list(CASES))
def test_expander_children_keep_the_target_law(case):
    cfg, draft_ids, budget = CASES[case]
    drafter = TableDrafter(draft_ids)
    ok, msg = chi_square_ok(exact_law(cfg), tree_counts(cfg, drafter, LAW_SAMPLES, POLICY, budget), n=LAW_SAMPLES)
    assert ok, msg


def _recorded_flat(q, *args, **kwargs):
    """Lossy: record a flattened q (the draws still follow the true one)."""
    flat = (q > 0).to(q.dtype)
    return flat / flat.sum()


@pytest.mark.parametrize("lossy", ["recorded law", "with replacement"])
def test_expander_negative_controls_fail(lossy, monkeypatch):
    cfg, draft_ids, budget = CASES["full vocab, T0.9 top-k 4"]
    if lossy == "recorded law":
        real_set = expander_mod.TreeBuilder.set_draft_probs
        monkeypatch.setattr(expander_mod.TreeBuilder, "set_draft_probs",
                            lambda self, node, q: real_set(self, node, _recorded_flat(q)))
    else:
        def with_replacement(q, count, generator):
            return torch.multinomial(q, count, replacement=True, generator=generator).tolist()

        monkeypatch.setattr(expander_mod, "draw_without_replacement", with_replacement)
    n = control_samples(LAW_SAMPLES)
    ok, msg = chi_square_ok(exact_law(cfg), tree_counts(cfg, TableDrafter(draft_ids), n, POLICY, budget), n=n)
    assert not ok, f"the lossy expander ({lossy}) passed: the test is vacuous ({msg})"


def _drafters():
    from test_eagle3 import _peaked_model as eagle_model, _sampling_drafter as eagle3
    from test_layerskip import _peaked_model as skip_model
    from test_lora_skip import _randomised

    skip = dict(exit_layer=1, width=3, branch=2, max_depth=2)
    return {
        "eagle3 native": lambda: (m := eagle_model(), eagle3(m, "native")),
        "eagle3 int8": lambda: (m := eagle_model(), eagle3(m, "int8")),
        "layerskip block": lambda: (m := skip_model(), build_drafter(m, "layerskip", **skip)),
        "layerskip lora": lambda: (m := skip_model(), _randomised(build_drafter(m, "layerskip", adapter="lora", rank=2,
                                                                                 **skip), scale=2.0)),
    }


@pytest.mark.parametrize("name", ["eagle3 native", "eagle3 int8", "layerskip block", "layerskip lora"])
def test_real_drafters_record_the_law_they_draw_from(name, monkeypatch):
    """Every sampled child of every step is drawn from exactly (bitwise) the law its parent records
    for the verifier, through the real drafter and engine (T = 0.9, top-k 4)."""
    model, drafter = _drafters()[name]()
    real_draw, real_verify = expander_mod.draw_without_replacement, verify_mod._verify_sampled
    drawn, steps = [], [0]

    def spy_draw(q, count, gen):
        drawn.append(q.clone())
        return real_draw(q, count, gen)

    def spy_verify(tree, probs, gen):
        if tree.num_nodes > 1:
            steps[0] += 1
            assert tree.draft_probs is not None and len(drawn) == tree.draft_probs.shape[0]
            for q, row in zip(drawn, tree.draft_probs):
                assert torch.equal(q, row)
        drawn.clear()
        return real_verify(tree, probs, gen)

    monkeypatch.setattr(expander_mod, "draw_without_replacement", spy_draw)
    monkeypatch.setattr(verify_mod, "_verify_sampled", spy_verify)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        selfspec.generate(model, torch.tensor([1, 2, 3]), drafter=drafter, max_new_tokens=8, temperature=0.9, top_k=4,
                          generator=gen, eos_token_id=[], control=False)
    assert steps[0] > 10
