"""Suffix drafting: the count trie is exact under inserts and evictions, drafts are best-first by
frequency with a budget that grows with the match, outputs stay exact (greedy identity on every
family, the target's law at T > 0 with a negative control), and past outputs are remembered."""

from __future__ import annotations

import random

import pytest
import torch

import selfspec
import selfspec.decoding.verify as verify_mod
from selfspec.drafters import SuffixConfig, SuffixDrafter
from selfspec.drafters.base import DraftContext
from selfspec.decoding.sampling import SamplingConfig
from selfspec.drafters.suffix_trie import SuffixTrie, TrieCursor
from test_distribution import chi_square_ok, control_samples, draw_with, exact_law
from tiny_models import FAMILIES, tiny_model


def _occurrences(seqs: list[list[int]], s: tuple[int, ...]) -> int:
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if tuple(q[i:i + n]) == s)


def _walk(trie: SuffixTrie):
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in node.children.items():
            yield path + (tok,), child
            stack.append((path + (tok,), child))


def test_trie_counts_equal_brute_force_under_inserts_and_removals():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    trie = SuffixTrie(max_depth=5)
    for s in seqs[:6]:
        trie.insert(s)
    cursor = TrieCursor()
    for s in seqs[6:]:  # a growing sequence, fed in pieces, counts like whole inserts
        grown = []
        for k in range(0, len(s), 3):
            trie.extend(cursor, s[k:k + 3])
            grown += s[k:k + 3]
        cursor = TrieCursor()
    for s in seqs[:4]:
        trie.remove(s)
    kept = seqs[4:]
    nodes = list(_walk(trie))
    assert len(nodes) == trie.num_nodes
    for path, node in nodes:
        assert len(path) <= 5 and node.count == _occurrences(kept, path) > 0, path
    # every substring of length <= 5 of what is kept is in the trie
    for q in kept:
        for i in range(len(q)):
            for n in range(1, 6):
                if i + n <= len(q):
                    assert tuple(q[i:i + n]) in dict(nodes)
    for s in seqs[4:]:
        trie.remove(s)
    assert trie.num_nodes == 0 and not trie.root.children
    with pytest.raises(KeyError):
        trie.remove([1, 2, 3])


def test_draft_is_best_first_by_frequency_and_budgeted_by_match_length():
    trie = SuffixTrie(max_depth=8)
    # after "7 8": 9 three times, 5 once; after "7 8 9": 1 twice, 2 once
    for s in ([7, 8, 9, 1], [7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 5]):
        trie.insert(s)
    node, n = trie.match([3, 7, 8])
    assert n == 2
    d = trie.draft(node, n, max_nodes=10, max_depth=5, min_prob=0.1)
    assert d.tokens[:2] == [9, 1] and d.parents[:2] == [-1, 0]
    assert d.probs[:3] == pytest.approx([0.75, 0.5, 0.25])
    assert all(p >= 0.1 for p in d.probs) and d.score == pytest.approx(sum(d.probs))
    assert trie.draft(node, n, max_nodes=10, max_depth=5, min_prob=0.6).tokens == [9]
    assert trie.draft(node, n, max_nodes=1, max_depth=5, min_prob=0.0).tokens == [9]
    assert trie.match([4, 4]) == (None, 0)
    # the drafter caps a tree at ceil(spec_factor * match_length) nodes
    drafter = SuffixDrafter(SuffixConfig(max_depth=8, max_nodes=4, spec_factor=1.0, min_prob=0.0))
    ctx = DraftContext(torch.tensor([7, 8, 9, 1, 0, 7, 8]), None, 6, SamplingConfig(0.0), torch.Generator())
    tree = drafter.propose(ctx)
    assert tree.num_nodes - 1 == 2 and tree.tokens[1:].tolist() == [9, 1]  # match "7 8": 2 nodes


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(family):
    model = tiny_model(family, vocab=64)
    prompt = torch.tensor([[3, 9, 27, 3, 9, 27, 3, 9, 5, 11]])
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    drafter = selfspec.build_drafter(model, "suffix")
    for _ in range(2):  # the second call also drafts from the first call's output
        out = selfspec.generate(model, prompt, drafter=drafter, max_new_tokens=40, control=False)
        assert torch.equal(out.sequences, reference)
    assert out.stats.mean_accepted_length > 2.0


def test_past_outputs_are_remembered_within_a_token_budget():
    model = tiny_model("llama", vocab=64)
    drafter = selfspec.build_drafter(model, "suffix", max_cached_tokens=100)
    prompts = [torch.tensor([[5, i, 7, 1 + i]]) for i in range(6)]
    for p in prompts:
        selfspec.generate(model, p, drafter=drafter, max_new_tokens=30, control=False)
    assert drafter.cached_tokens <= 100 and len(drafter.outputs) == 3  # the oldest evicted
    nodes = sum(1 for _ in _walk(drafter.history))
    assert nodes == drafter.history.num_nodes <= 100 * drafter.config.max_depth
    again = selfspec.generate(model, prompts[-1], drafter=drafter, max_new_tokens=30, control=False)
    cold = selfspec.generate(model, prompts[-1], drafter=selfspec.build_drafter(model, "suffix"), max_new_tokens=30,
                             control=False)
    assert torch.equal(again.sequences, cold.sequences)
    assert again.stats.mean_accepted_length > cold.stats.mean_accepted_length


def _point_always_accepted(batch, rows, parent, child, earlier, like):
    """Lossy: a point-mass draft treated as if drawn from the target's own law (never rejected)."""
    point = (batch.laws[child] == 0)[:, None]
    return torch.where(point, like, _exact_child_laws(batch, rows, parent, child, earlier, like))


_exact_child_laws = verify_mod._child_laws


@pytest.mark.parametrize("lossy", [False, True])
def test_law_at_temperature_with_history_and_negative_control(monkeypatch, lossy):
    """One drafter across all draws, so its history (with evictions) fills with the target's own
    samples and drafts them back; the law of the first 3 tokens must equal the target's. The same
    harness with point-mass drafts never rejected must fail."""
    cfg, prompt = SamplingConfig(1.0, top_k=4), [1, 2, 1, 2, 1]
    if lossy:
        monkeypatch.setattr(verify_mod, "_child_laws", _point_always_accepted)
    drafter = SuffixDrafter(SuffixConfig(max_depth=6, min_prob=0.05, max_cached_tokens=3000))
    n = control_samples(20000) if lossy else 20000
    ok, msg = chi_square_ok(exact_law(cfg, prompt), draw_with(cfg, drafter, n=n, prompt=prompt), n=n)
    assert drafter.cached_tokens <= 3000
    assert ok != lossy, msg
