"""Draft trees, templates, the n-gram drafter and the verifier as units."""

from __future__ import annotations

import pytest
import torch

from selfspec.drafters.base import DraftContext
from selfspec.drafters.ngram import NgramConfig, NgramDrafter
from selfspec.decoding.sampling import SamplingConfig, target_probs
from selfspec.decoding.tree import DraftTree, Law, TreeBuilder, TreeTemplate
from selfspec.decoding.verify import verify_tree


def test_builder_depths_children_ancestors():
    b = TreeBuilder(10)
    a = b.add(0, 11)
    c = b.add(0, 12)
    d = b.add(a, 13)
    tree = b.build()
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.children == ((a, c), (d,), (), ())
    assert tree.path_to(d) == [0, a, d]
    anc = tree.ancestors()
    assert anc[d].tolist() == [True, True, False, True]
    assert anc[c].tolist() == [True, False, True, False]


def test_invalid_trees_are_refused():
    with pytest.raises(ValueError, match="precede"):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="root"):
        DraftTree(torch.tensor([1]), torch.tensor([0]), torch.zeros(1, dtype=torch.long))
    b = TreeBuilder(1)
    b.add(0, 2, Law.IID)
    with pytest.raises(ValueError, match="draft distribution"):
        b.build()


def test_template_fill_and_validation():
    tpl = TreeTemplate([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tpl.num_nodes == 7 and tpl.depth == 3 and tpl.max_rank == 2
    cands = torch.tensor([[100, 101], [200, 201], [300, 301]])
    tree = tpl.fill(5, cands)
    assert tree.tokens.tolist() == [5, 100, 101, 200, 201, 200, 300]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="lacks its parent"):
        TreeTemplate([(0, 1)])
    with pytest.raises(ValueError, match="candidates"):
        tpl.fill(5, cands[:2])
    assert TreeTemplate.full(2, 2).num_nodes == 7
    assert TreeTemplate.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


def test_prune_depth_keeps_shallow_nodes():
    tree = TreeTemplate.full(2, 3).fill(0, torch.arange(6).view(3, 2))
    pruned = tree.prune_depth(1)
    assert pruned.num_nodes == 3 and pruned.depth == 1
    assert tree.prune_depth(3) is tree


def _ctx(tokens, max_depth=8):
    return DraftContext(torch.tensor(tokens), None, max_depth, SamplingConfig(), torch.Generator())


def test_ngram_drafts_continuations_as_a_trie():
    drafter = NgramDrafter(NgramConfig(max_ngram=2, min_ngram=1, max_depth=3))
    # "7 8" occurs twice before the end, followed by 1 2 3 and by 1 4 5: one trie with a fork at depth 2
    tree = drafter.propose(_ctx([7, 8, 1, 4, 5, 7, 8, 1, 2, 3, 0, 7, 8]))
    assert tree.tokens[0] == 8
    paths = {tuple(tree.tokens[tree.path_to(i)].tolist()) for i in range(tree.num_nodes) if not tree.children[i]}
    assert (8, 1, 2, 3) in paths and (8, 1, 4, 5) in paths
    assert tree.tokens[tree.children[0][0]] == 1 and len(tree.children[0]) >= 1
    assert drafter.propose(_ctx([7, 8, 1, 2], max_depth=0)).num_nodes == 1


def test_ngram_merges_at_most_four_matches_and_drafts_nothing_without_one():
    drafter = NgramDrafter(NgramConfig(max_ngram=1, min_ngram=1, max_depth=1))
    tree = drafter.propose(_ctx([1, 2, 1, 3, 1, 4, 1, 5, 1, 6, 1]))  # five earlier "1"s: the four latest
    assert sorted(tree.tokens[1:].tolist()) == [3, 4, 5, 6]
    assert drafter.propose(_ctx([1, 2, 3, 4])).num_nodes == 1



def test_ngram_grows_its_first_chain_while_accepted_whole_and_resets_on_a_miss():
    """``long_depth``: a step that accepts the whole of the first match's chain, drafted to its cap,
    doubles the cap (8 -> 16 -> 32, the node budget growing with it), compared token by token with
    what the step committed; a step that rejects part of it, or a new generation, returns it to
    ``max_depth``; a chain accepted whole short of its cap (the continuation ran out, or the step
    had room for fewer tokens) neither grows nor lowers it; a step whose tree was not its own
    leaves the cap as it is. Equal to ``max_depth`` the depth is fixed."""
    from selfspec.drafters.base import Step
    from selfspec.decoding.verify import Verdict

    def observe(drafter, tree, verdict):
        tokens = tree.tokens[verdict.path[1:]].tolist() + [verdict.next_token]
        drafter.observe(Step(tokens, tree, verdict, proposed=True))

    cycle = list(range(10, 50))  # a 40-token cycle: every suffix matches one period earlier
    context = cycle * 3

    def chain(tree):
        node, out = 0, []
        while tree.children[node]:
            node = tree.children[node][0]
            out.append(int(tree.tokens[node]))
        return out

    def step(drafter, accept: int | None = None):
        """Propose, then observe a verdict accepting ``accept`` nodes of the first chain (all: None)."""
        tree = drafter.propose(_ctx(context, max_depth=64))
        first = [0]
        while tree.children[first[-1]]:
            first.append(tree.children[first[-1]][0])
        path = first if accept is None else first[: accept + 1]
        observe(drafter, tree, Verdict(path, 0, accept is None))
        return chain(tree)

    drafter = NgramDrafter(NgramConfig(max_ngram=2, min_ngram=1, max_depth=8, long_depth=32))
    assert [len(step(drafter)) for _ in range(4)] == [8, 16, 32, 32]
    assert step(drafter, accept=5)[:5] == cycle[:5]  # drafted 32 deep, five accepted: back to 8
    assert len(step(drafter)) == 8 and len(step(drafter)) == 16
    drafter.reset()
    assert len(step(drafter)) == 8
    context = list(range(60, 70)) * 3  # a 10-token cycle: the chain runs out after 10 tokens...
    assert len(step(drafter)) == 10 and len(step(drafter)) == 10  # ...accepted whole: cap stays 16
    context = cycle * 3
    assert len(step(drafter)) == 16
    short = drafter.propose(_ctx(context, max_depth=6))  # a step with room for 6, accepted whole
    observe(drafter, short, Verdict(list(range(7)), 0, True))
    assert len(step(drafter)) == 32  # neither grew from nor lowered to the room's 6: 16 -> 32 above
    tree = drafter.propose(_ctx(context, max_depth=64))  # a step whose tree another drafter's run verified:
    drafter.observe(Step([1, 2], tree, Verdict([0], 1, False), proposed=False))  # not judged
    assert len(step(drafter)) == 32
    drafter.reset()
    short = drafter.propose(_ctx(context, max_depth=6))  # at cap 8, room for 6, accepted whole:
    observe(drafter, short, Verdict(list(range(7)), 0, True))
    assert len(step(drafter)) == 8  # not grown from the room's 6 to 12
    fixed = NgramDrafter(NgramConfig(max_ngram=2, min_ngram=1, max_depth=8, long_depth=8))
    assert [len(step(fixed)) for _ in range(3)] == [8, 8, 8]
    with pytest.raises(ValueError, match="long_depth"):
        NgramConfig(max_depth=8, long_depth=4)
    assert NgramConfig().grown_depth == 32 and NgramConfig(max_depth=40).grown_depth == 40

def test_ngram_search_finds_every_earlier_occurrence_once_per_context():
    """The one-pass search returns, for every n, the continuation starts of all earlier occurrences
    of the last n tokens (checked against a brute-force scan on random contexts over small
    vocabularies, where matches of every length abound); a context's key and tree share one search."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(400):
        length, vocab = int(torch.randint(1, 40, (1,), generator=rng)), [2, 3, 7][trial % 3]
        tokens = torch.randint(0, vocab, (length,), generator=rng)
        low = 1 + trial % 3
        drafter = NgramDrafter(NgramConfig(max_ngram=low + trial % 4, min_ngram=low))
        seq, high = tokens.tolist(), min(low + trial % 4, length - 1)
        expected = {n: [i + n for i in range(length - n) if seq[i:i + n] == seq[length - n:]]
                    for n in range(low, high + 1)}
        assert drafter._search(tokens) == expected
    drafter, calls = NgramDrafter(NgramConfig(max_ngram=2, min_ngram=1)), []
    search = drafter._search.__func__

    def counted(self, context):
        calls.append(self._found is None or self._found[0] is not context or self._found[1] != context._version)
        return search(self, context)

    drafter._search = counted.__get__(drafter)
    ctx = _ctx([7, 8, 1, 4, 5, 7, 8, 1, 2, 3, 0, 7, 8])
    assert drafter.context_key(ctx) == 2 and drafter.propose(ctx).num_nodes > 1
    assert calls == [True, False]  # searched once: the tree reused the key's search
    drafter.propose(_ctx([7, 8, 1, 4, 5, 7, 8, 1, 2, 3, 0, 7, 8]))  # another context: searched again
    assert calls[-1] is True
    ctx.tokens[-2:] = torch.tensor([6, 6])  # the same tensor written in place: searched again (key 1: "6" before)
    assert drafter.context_key(ctx) == 1 and calls[-1] is True


def test_ngram_key_is_the_longest_matched_suffix():
    """Prompt lookup's context key: the longest suffix ``n`` that occurs earlier (0: none, an
    empty draft), whatever runs on beyond it."""
    text = list(range(10, 40))
    key = lambda tokens, **kw: NgramDrafter(NgramConfig(**kw)).context_key(_ctx(tokens))  # noqa: E731
    assert key(text) == 0
    assert key(text + [1, 2] + text[:3]) == 3 and key(text + [1, 2] + text[:4]) == 4
    assert key(text + [1, 2] + text[:16]) == 4  # a long copy is still a max_ngram match
    assert key(text + [1, 2] + text[:8], max_ngram=2, min_ngram=1) == 2


def test_greedy_verdict_accepts_deepest_matching_path():
    b = TreeBuilder(0)
    a = b.add(0, 2)
    b.add(0, 3)
    d = b.add(a, 4)
    tree = b.build()
    logits = torch.full((4, 6), -1.0)
    logits[0, 2] = logits[a, 4] = logits[d, 5] = 1.0  # root predicts 2, node a predicts 4
    verdict = verify_tree(tree, logits, SamplingConfig())
    assert verdict.path == [0, a, d] and verdict.next_token == 5 and verdict.bonus


def test_sampling_needs_a_generator():
    with pytest.raises(ValueError, match="Generator"):
        verify_tree(DraftTree.root_only(1), torch.zeros(1, 4), SamplingConfig(1.0))


def test_all_zero_residual_falls_back_instead_of_emitting_zero_probability():
    """Target is a point mass on token 2; a drafted child 2 sampled from q = p must be accepted."""
    b = TreeBuilder(0)
    q = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    b.set_draft_probs(0, q)
    b.add(0, 2, Law.IID)
    b.add(0, 2, Law.IID)
    tree = b.build()
    logits = torch.tensor([[-1e4, -1e4, 0.0, -1e4]] * 3, dtype=torch.float64)
    for seed in range(20):
        verdict = verify_tree(tree, logits, SamplingConfig(1.0), torch.Generator().manual_seed(seed))
        assert verdict.path[:2] == [0, 1] and verdict.next_token == 2


def _forced_rejection(monkeypatch, tree, probs):
    """Verify ``tree`` with every coin just below 1 (so a child whose law is not below the residual
    at its token is rejected); returns the law the final token was drawn from."""
    import selfspec.decoding.verify as verify_mod

    drawn = []
    real_draw = verify_mod._draw
    monkeypatch.setattr(torch, "rand", lambda *size, **kw: torch.full(size, 1.0 - 2.0 ** -53, dtype=torch.float64))
    monkeypatch.setattr(verify_mod, "_draw", lambda p, g: (drawn.append(p.clone()), real_draw(p, g))[1])
    verdict = verify_mod._verify_sampled(tree, probs, torch.Generator().manual_seed(0))
    monkeypatch.undo()
    return verdict, drawn[-1][0]


def test_residual_fallback_is_reached_when_rounding_leaves_no_mass(monkeypatch):
    """p puts 1 - 1e-15 on token 2, a point child drafts 2 and is rejected (forced coin): the
    updated residual (p minus the point mass) holds only 1e-15 of rounding-level mass, so the
    recovered token is drawn from the pre-update residual, not from renormalised noise."""
    p = torch.tensor([[4e-16, 3e-16, 1 - 1e-15, 3e-16]], dtype=torch.float64).expand(2, -1)
    b = TreeBuilder(0)
    b.add(0, 2, Law.POINT)
    verdict, law = _forced_rejection(monkeypatch, b.build(), p)
    assert verdict.path == [0]  # rejected
    torch.testing.assert_close(law, p[0], rtol=0, atol=0)  # the fallback: the residual before the update


def test_residual_floor_follows_the_dtype(monkeypatch):
    """In float32, a draft law equal to the target's up to rounding leaves ~1e-7 of noise after a
    rejection: above the old fixed floor (1e-12), below float32's (16 eps = 1.9e-6), so the noise is
    not renormalised into a law. In float64 the floor is 3.6e-15."""
    from selfspec.decoding.verify import residual_floor

    assert residual_floor(torch.float32) == pytest.approx(1.9e-6, rel=0.01)
    assert residual_floor(torch.float64) == pytest.approx(3.55e-15, rel=0.01)
    logits = torch.linspace(0, 3, 50, dtype=torch.float32)
    p = logits.softmax(-1)
    q = (logits * (1 + 1e-7)).softmax(-1)  # the same law, rounded differently
    noise = float((p - q).clamp_min(0).sum())
    assert 1e-12 < noise < residual_floor(torch.float32)
    b = TreeBuilder(0)
    b.set_draft_probs(0, q)
    b.add(0, int(q.argmax()), Law.IID)
    verdict, law = _forced_rejection(monkeypatch, b.build(), p[None].expand(2, -1))
    assert verdict.path == [0]
    torch.testing.assert_close(law, p, rtol=0, atol=0)


def test_top_p_and_top_k_filter_like_plain_sampling():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(1.0, top_p=0.75))
    assert p.tolist() == pytest.approx([0.625, 0.375, 0, 0])
    p = target_probs(logits, SamplingConfig(1.0, top_k=3))
    assert p[3] == 0 and p.sum() == pytest.approx(1)
    p = target_probs(logits, SamplingConfig(1.0, top_p=0.3))
    assert p.tolist() == [1.0, 0, 0, 0]
