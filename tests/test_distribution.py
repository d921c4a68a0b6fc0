"""Distribution equality at T > 0 (shared/docs/EXACTNESS.md).

Two harnesses over a table-driven target with a 6-token vocabulary (logits depend on the last two
tokens), whose law of the first three generated tokens is enumerated exactly:

* **Batched exact-table harness** (most tests): the target's law for every two-token prefix is
  computed once; N = 2e5 generations (1e6 for one case) walk in lockstep, each round drafting one tree per walker
  (vectorised stub drafts: point-mass, i.i.d., without-replacement and mixed children, all poor so
  that acceptances, recoveries and bonus tokens all occur) and verifying all of them with the
  engine's own verifier (:func:`selfspec.decoding.verify.verify_batch`, the code ``verify_tree`` runs with
  B = 1). Every child law is crossed with temperature, top-k and top-p. Seconds per case.
* **Decode-loop harness**: fewer samples through the real engine loop (``decode``: tree
  building, the target protocol, commits, the controller's arms, merges and cuts), for what the
  batched harness skips.

Test: Pearson chi-square at a 1e-6 false-failure rate; cells with expected count < 5 are pooled;
any sample outside the support fails. Power (``detectable_tv``): with 130-215 pooled cells at
alpha 1e-6, a law whose total-variation distance from the target's is at least 1.4% (N = 2e5),
0.62% (N = 1e6) or 4.4% (N = 2e4, the decode-loop and model harnesses) fails with probability
>= 0.9, whatever the shape of the bias (a chi-square divergence D >= 4 TV^2); biases that
concentrate on a few cells are caught far smaller. Negative controls run the same harnesses with
lossy rules and must fail, on a quarter of their harness's samples (:func:`control_samples`).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

import selfspec.decoding.verify as verify_mod
from stubs import decode
from selfspec.decoding.sampling import SamplingConfig, sample, target_probs
from selfspec.decoding.tree import DraftTree, Law
from selfspec.decoding.verify import TreeBatch, verify_batch
from stubs import ScriptedDrafter, TimedTarget, VirtualClock, fixed, table_target

VOCAB, PROMPT, NEW, SAMPLES = 6, [1, 2], 3, 20000
BATCH_SAMPLES = 200_000


def control_samples(n: int) -> int:
    """How many samples a negative control draws in a harness of ``n``: a quarter. Every lossy
    rule the decode-loop and model harnesses use fails there by orders of magnitude (measured in
    round 25 at a quarter: chi-square 15,067 against a limit of 117 for the stale bonus token in
    the decode loop, 68,874 against 141 with Medusa heads, 332,086 against 105 for suffix drafts
    never rejected, samples outside the support in the top-k cases), and under a fixed lossy law
    the expected chi-square grows linearly with the sample count, so a rule caught at n/4 is
    caught at n. Controls drew the full n before: about a quarter of the suite's time went to them."""
    return max(1, n // 4)


def exact_law(cfg: SamplingConfig, prompt: list[int] = PROMPT) -> dict[tuple[int, ...], float]:
    target = table_target(VOCAB)
    law = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW):
        ctx, prob = list(prompt), 1.0
        for tok in seq:
            prob *= float(target_probs(target.logits_after(ctx), cfg)[tok])
            ctx.append(tok)
        if prob > 0:
            law[seq] = prob
    return law


def draw_with(cfg: SamplingConfig, drafter, *, n: int = SAMPLES, seed: int = 0, hidden_size: int = 0,
              prompt: list[int] = PROMPT) -> dict[tuple[int, ...], int]:
    """Counts of the first NEW tokens over n speculative generations through the decode loop."""
    target, gen, counts = table_target(VOCAB, hidden_size=hidden_size), torch.Generator().manual_seed(seed), {}
    ids = torch.tensor(prompt)
    controller = fixed(drafter)  # every step drafts, whole trees verified
    for _ in range(n):
        out = decode(target, ids, controller, cfg, gen, NEW, set(), 100)
        key = tuple(out.sequences[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts


def draw(cfg: SamplingConfig, drafter, n: int = SAMPLES, seed: int = 0) -> dict[tuple[int, ...], int]:
    return draw_with(cfg, drafter, n=n, seed=seed)


def chi_square_ok(law, counts, n: int = SAMPLES, alpha: float = 1e-6) -> tuple[bool, str]:
    outside = set(counts) - set(law)
    if outside:
        return False, f"samples outside the support: {sorted(outside)[:5]}"
    cells = sorted(law, key=law.get)
    stat, dof, pool_e, pool_o = 0.0, -1, 0.0, 0
    for cell in cells:  # pool the smallest cells until each pooled group expects >= 5
        pool_e += law[cell] * n
        pool_o += counts.get(cell, 0)
        if pool_e >= 5:
            stat += (pool_o - pool_e) ** 2 / pool_e
            dof += 1
            pool_e, pool_o = 0.0, 0
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        dof += 1
    limit = chi2.ppf(1 - alpha, dof)
    return stat <= limit, f"chi2={stat:.1f} dof={dof} limit={limit:.1f}"


def detectable_tv(n: int, dof: int, alpha: float = 1e-6, power: float = 0.9) -> float:
    """Smallest total-variation bias the chi-square test catches with ``power`` (any bias shape:
    the chi-square divergence of a law at TV distance e is at least 4 e^2)."""
    from scipy.optimize import brentq
    from scipy.stats import ncx2

    limit = chi2.ppf(1 - alpha, dof)
    lam = brentq(lambda x: ncx2.sf(limit, dof, x) - power, 1e-3, 1e6)
    return (lam / n) ** 0.5 / 2


# ---------------------------------------------------------------- the batched exact-table harness
class BatchedScript:
    """Vectorised :class:`stubs.ScriptedDrafter`: depth-2 trees of one shape for B walkers.

    Root children: ``point`` point-mass tokens (a fixed table of the root token), then ``sampled``
    tokens drawn from a draft law q (a fixed random softmax of the root token, unrelated to the
    target) i.i.d. or without replacement (excluding the point siblings); under the first root
    child, the same again. Returns the shared shape, ``tokens [B, n]`` and ``draft_probs [B, 2, V]``.
    """

    def __init__(self, point: int, sampled: int, law: Law = Law.WOR, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.q_table = (torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
        self.point_table = torch.randint(0, VOCAB, (VOCAB, max(point, 1)), generator=g)
        self.point, self.sampled, self.law = point, sampled, law
        per = point + sampled
        parents = [-1] + [0] * per + [1] * per
        laws = [Law.POINT] + ([Law.POINT] * point + [law] * sampled) * 2
        row = [-1] * len(parents)
        if sampled:
            row[0], row[1] = 0, 1
        self.shape = DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents),
                               torch.tensor([int(x) for x in laws]),
                               torch.zeros(2, VOCAB, dtype=torch.float64) if sampled else None,
                               torch.tensor(row))

    def _children(self, last: torch.Tensor, gen: torch.Generator, law: Law | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        law = law or self.law
        kids = [self.point_table[last, :self.point]]
        q = self.q_table[last]  # [b, V]
        if self.sampled:
            if law == Law.IID:
                kids.append(torch.multinomial(q, self.sampled, replacement=True, generator=gen))
            else:
                base = q.clone()
                if self.point:
                    base.scatter_(1, kids[0], 0.0)
                kids.append(torch.multinomial(base / base.sum(-1, keepdim=True), self.sampled, replacement=False,
                                              generator=gen))
        return torch.cat(kids, dim=1), q

    def propose(self, root: torch.Tensor, gen: torch.Generator) -> TreeBatch:
        first, q0 = self._children(root, gen)
        second, q1 = self._children(first[:, 0], gen)
        tokens = torch.cat([root[:, None], first, second], dim=1)
        return TreeBatch(self.shape, tokens, torch.stack([q0, q1], dim=1) if self.sampled else None)


class TwoLawScript(BatchedScript):
    """Depth-2 trees whose two root children (drawn without replacement) have children of two
    laws: two i.i.d. draws under the first, two draws without replacement under the second. Walkers
    standing on the two nodes test one column of children with both laws at once."""

    def __init__(self, seed: int = 1):
        super().__init__(point=0, sampled=2, law=Law.WOR, seed=seed)
        laws = [Law.POINT, Law.WOR, Law.WOR, Law.IID, Law.IID, Law.WOR, Law.WOR]
        self.shape = DraftTree(torch.zeros(7, dtype=torch.long), torch.tensor([-1, 0, 0, 1, 1, 2, 2]),
                               torch.tensor([int(x) for x in laws]), torch.zeros(3, VOCAB, dtype=torch.float64),
                               torch.tensor([0, 1, 2, -1, -1, -1, -1]))

    def propose(self, root: torch.Tensor, gen: torch.Generator) -> TreeBatch:
        first, q0 = self._children(root, gen, Law.WOR)
        under1, q1 = self._children(first[:, 0], gen, Law.IID)
        under2, q2 = self._children(first[:, 1], gen, Law.WOR)
        tokens = torch.cat([root[:, None], first, under1, under2], dim=1)
        return TreeBatch(self.shape, tokens, torch.stack([q0, q1, q2], dim=1))


class RootOnly:
    """Plain decoding: one-node trees (the next token is the bonus draw from the full p)."""

    shape = DraftTree(torch.zeros(1, dtype=torch.long), torch.tensor([-1]), torch.tensor([0]))

    def propose(self, root: torch.Tensor, gen: torch.Generator) -> TreeBatch:
        return TreeBatch(self.shape, root[:, None])


def batched_counts(cfg: SamplingConfig, drafter, n: int = BATCH_SAMPLES, seed: int = 0,
                   dtype: torch.dtype = torch.float64) -> dict[tuple[int, ...], int]:
    """Counts of the first NEW tokens of n generations, all walking in lockstep; ``dtype``: of the
    target's logits (float32: the probability path of a float32 or bf16 model)."""
    table = target_probs(table_target(VOCAB).table.to(dtype), cfg)  # [V, V, V]: the law after every 2-token prefix
    gen = torch.Generator().manual_seed(seed)
    seq = torch.zeros(n, 2 + NEW + 3, dtype=torch.long)
    seq[:, :2] = torch.tensor(PROMPT[-2:])
    length = torch.full((n,), 2, dtype=torch.long)
    active = torch.arange(n)
    while active.numel():
        prev, root = seq[active, length[active] - 2], seq[active, length[active] - 1]
        batch = drafter.propose(root, gen)
        if batch.draft_probs is not None and batch.draft_probs.dtype != table.dtype:
            batch = TreeBatch(batch.shape, batch.tokens, batch.draft_probs.to(table.dtype))
        shape, tokens = batch.shape, batch.tokens
        parents = shape.parents
        before = torch.empty_like(tokens)  # the token before each node (its context is (before, node))
        before[:, 0] = prev
        for i in range(1, shape.num_nodes):
            before[:, i] = tokens[:, int(parents[i])]
        probs = table[before, tokens]  # [b, n, V]
        last, nxt, _ = verify_batch(batch, probs, gen)
        depth = shape.depths[last]
        depths = shape.depths
        chain, node = [last], last
        for _ in range(shape.depth):  # last's ancestors, up to the root
            node = torch.where(depths[node] > 0, parents[node.clamp_min(1)], node)
            chain.append(node)
        for d in range(1, shape.depth + 1):  # the accepted token at depth d
            at_d = last.clone()
            for c in chain:
                at_d = torch.where(depths[c] == d, c, at_d)
            has = depth >= d
            seq[active[has], length[active[has]] + d - 1] = tokens[has, at_d[has]]
        seq[active, length[active] + depth] = nxt
        length[active] += depth + 1
        active = active[length[active] < 2 + NEW]
    code = torch.zeros(n, dtype=torch.long)
    for j in range(NEW):
        code = code * VOCAB + seq[:, 2 + j]
    counts = torch.bincount(code, minlength=VOCAB ** NEW).tolist()
    return {seq_: c for seq_, c in zip(itertools.product(range(VOCAB), repeat=NEW), counts) if c}


SETTINGS = {
    "T1": SamplingConfig(1.0),
    "T0.7-topk3": SamplingConfig(0.7, top_k=3),
    "T1.3-topp0.8": SamplingConfig(1.3, top_p=0.8),
    "T0.5-topk4-topp0.9": SamplingConfig(0.5, top_k=4, top_p=0.9),
}
DRAFTS = {
    "point": dict(point=2, sampled=0),
    "iid": dict(point=0, sampled=3, law=Law.IID),
    "wor": dict(point=0, sampled=3, law=Law.WOR),
    "mixed": dict(point=1, sampled=2, law=Law.WOR),
}
BATCHED = {name: (lambda kw=kw: BatchedScript(**kw)) for name, kw in DRAFTS.items()} | {"plain": RootOnly}


@pytest.mark.parametrize("draft", list(BATCHED))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batched_law_equals_target_law(setting, draft):
    """Every child law (and plain decoding) crossed with T / top-k / top-p, N = 2e5."""
    cfg = SETTINGS[setting]
    law = exact_law(cfg)
    ok, msg = chi_square_ok(law, batched_counts(cfg, BATCHED[draft]()), n=BATCH_SAMPLES)
    assert ok, msg


@pytest.mark.parametrize("draft", ["mixed", "wor", "point"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batched_law_in_float32(setting, draft):
    """The float32 probability path (a float32 or bf16 model's logits; draft laws in float32):
    the same harness, N = 2e5."""
    cfg = SETTINGS[setting]
    counts = batched_counts(cfg, BATCHED[draft](), dtype=torch.float32)
    ok, msg = chi_square_ok(exact_law(cfg), counts, n=BATCH_SAMPLES)
    assert ok, msg


@pytest.mark.parametrize("lossy", [False, True])
def test_a_column_mixing_child_laws_keeps_the_law(monkeypatch, lossy):
    """Walkers at different nodes test children of different laws in one column (WOR children of
    the root, IID children of its first child): the verifier's row-by-row branch. It is reached,
    and the law is the target's; with that column's children tested as if drawn from the residual
    itself (``lossy``: always accepted) the harness fails."""
    reached = []

    def spy(batch, rows, parent, child, earlier, like):
        laws = batch.laws[child]
        wor = laws == Law.WOR
        if bool(wor.any()) and not bool(wor.all()) and bool((laws != Law.POINT).all()):
            reached.append(True)
            if lossy:
                return like
        return _exact_child_laws(batch, rows, parent, child, earlier, like)

    monkeypatch.setattr(verify_mod, "_child_laws", spy)
    cfg = SETTINGS["T1"]
    ok, msg = chi_square_ok(exact_law(cfg), batched_counts(cfg, TwoLawScript()), n=BATCH_SAMPLES)
    assert reached
    assert ok != lossy, msg


def test_mixed_children_at_one_million_samples():
    cfg = SETTINGS["T1.3-topp0.8"]
    ok, msg = chi_square_ok(exact_law(cfg), batched_counts(cfg, BATCHED["mixed"](), n=1_000_000), n=1_000_000)
    assert ok, msg


def test_the_batched_harness_detects_a_one_percent_bias():
    """Its stated power (module docstring), and a law 1% off in total variation (spread over all
    cells, the hardest shape) is caught at N = 1e6."""
    assert detectable_tv(BATCH_SAMPLES, 215) < 0.014
    assert detectable_tv(1_000_000, 215) < 0.0063
    assert detectable_tv(SAMPLES, 215) < 0.045
    cfg = SETTINGS["T1"]
    law = exact_law(cfg)
    g = torch.Generator().manual_seed(5)
    uniform = 1.0 / len(law)
    eps = 0.01 / (0.5 * sum(abs(v - uniform) for v in law.values()))  # mixing in eps of uniform: TV = 1%
    shifted = {k: (1 - eps) * v + eps * uniform for k, v in law.items()}
    assert abs(0.5 * sum(abs(shifted[k] - law[k]) for k in law) - 0.01) < 1e-9
    total = 1.0
    cells = list(shifted)
    draws = torch.multinomial(torch.tensor([shifted[c] / total for c in cells]), 1_000_000, replacement=True,
                              generator=g)
    counts = {}
    for i, c in zip(*torch.unique(draws, return_counts=True)):
        counts[cells[int(i)]] = int(c)
    ok, msg = chi_square_ok(law, counts, n=1_000_000)
    assert not ok, f"a biased law passed at N = 1e6 ({msg})"


def _wor_as_iid(batch, rows, parent, child, earlier, like):
    """Pitfall 1: reuse q after a rejection for children drawn without replacement."""
    return _exact_child_laws(batch, rows, parent, child, torch.zeros_like(earlier), like)


def _draft_as_target(batch, rows, parent, child, earlier, like):
    """Pitfall: a child tested as if it had been drawn from the residual itself (always accepted).
    (Testing a sampled child as a point mass instead is *not* lossy, only slower: the verifier
    conditions on the drawn token; an earlier version of this control found that out.)"""
    return like


_exact_child_laws = verify_mod._child_laws


@pytest.mark.parametrize("lossy", ["wor_as_iid", "draft_as_target", "recover_from_p"])
def test_batched_negative_controls_fail(monkeypatch, lossy):
    """The same harness, N and threshold with a lossy rule: each must fail."""
    cfg = SETTINGS["T1"]
    if lossy == "wor_as_iid":
        monkeypatch.setattr(verify_mod, "_child_laws", _wor_as_iid)
        drafter = BatchedScript(point=0, sampled=3, law=Law.WOR)
    elif lossy == "draft_as_target":
        monkeypatch.setattr(verify_mod, "_child_laws", _draft_as_target)
        drafter = BatchedScript(point=1, sampled=2, law=Law.IID)
    else:  # Pitfall 3: the recovered token drawn from p instead of the residual
        monkeypatch.setattr(verify_mod, "residual_floor", lambda dtype: float("inf"))
        drafter = BatchedScript(point=2, sampled=0)
    ok, msg = chi_square_ok(exact_law(cfg), batched_counts(cfg, drafter), n=BATCH_SAMPLES)
    assert not ok, f"the lossy rule {lossy} passed the exactness test ({msg}): the test is vacuous"


def test_testing_sampled_children_as_point_masses_is_still_exact(monkeypatch):
    """Accepting a drawn x with probability r(x) (the point-mass rule) and removing x from the
    residual keeps the law whatever q was (it conditions on x), only accepting less: the harness
    must not call it lossy."""
    def as_point(batch, rows, parent, child, earlier, like):
        return torch.nn.functional.one_hot(batch.tokens[rows, child], like.shape[-1]).to(like)

    monkeypatch.setattr(verify_mod, "_child_laws", as_point)
    cfg = SETTINGS["T1"]
    ok, msg = chi_square_ok(exact_law(cfg), batched_counts(cfg, BatchedScript(point=0, sampled=2, law=Law.IID)),
                            n=BATCH_SAMPLES)
    assert ok, msg


# ---------------------------------------------------------------- the decode-loop harness
def test_decode_loop_law_equals_target_law():
    """Mixed children through the engine's own loop (tree building, target protocol, commits)."""
    cfg = SETTINGS["T1.3-topp0.8"]
    ok, msg = chi_square_ok(exact_law(cfg), draw(cfg, ScriptedDrafter(VOCAB, **DRAFTS["mixed"])))
    assert ok, msg


def _stale_bonus(tree, probs, generator):
    """Pitfall 5: the bonus token drawn from the parent's law instead of the leaf's full p."""
    verdict = _exact_sampled(tree, probs, generator)
    if verdict.bonus and len(verdict.path) > 1:
        parent = verdict.path[-2]
        return verify_mod.Verdict(verdict.path, sample(probs[parent], generator), True)
    return verdict


_exact_sampled = verify_mod._verify_sampled



@pytest.mark.parametrize("lossy", [False, True])
def test_prompt_lookup_with_grown_chains_keeps_the_law(lossy, monkeypatch):
    """Prompt lookup whose first chain grows after whole acceptances (``long_depth``: its depth
    depends on the past steps' verdicts, hence on the past draws) through the decode loop at T = 0.7,
    top-k 3, on a prompt it copies from (the target's greedy path): the law of the first five tokens (at top-k 3: 243 outcomes; five,
    so that a grown chain has room to be drafted) is the target's. With a stale bonus token
    (``lossy``) the same harness must fail."""
    import test_distribution as here
    from selfspec.drafters.ngram import NgramConfig, NgramDrafter

    if lossy:
        monkeypatch.setattr(verify_mod, "_verify_sampled", _stale_bonus)
    monkeypatch.setattr(here, "NEW", 5)
    table = table_target(VOCAB).table
    prompt = [1, 2]  # the target's greedy path, which falls into a cycle lookup can copy from
    while len(prompt) < 40:
        prompt.append(int(table[prompt[-2], prompt[-1]].argmax()))
    cfg = SETTINGS["T0.7-topk3"]
    drafter = NgramDrafter(NgramConfig(max_ngram=2, min_ngram=1, max_depth=1, long_depth=4))
    depths = []
    propose = drafter.propose

    def spy(ctx):
        depths.append(min(drafter._depth, ctx.max_depth))  # the first chain's cap this step
        return propose(ctx)

    drafter.propose = spy
    n = control_samples(SAMPLES) if lossy else SAMPLES
    ok, msg = chi_square_ok(exact_law(cfg, prompt), draw_with(cfg, drafter, n=n, prompt=prompt), n=n)
    assert max(depths) > 1  # chains did grow (and had room: five new tokens)
    assert ok != lossy, msg

def _controller_counts(cfg, members, n, *, force=True, spy=None):
    """Counts of the first NEW tokens through ``decode`` under one learning controller over
    ``members`` (Thompson draws from its own generator, virtual timings); with ``force`` every
    other step's arm is rotated over all arms (chosen from the step count only: the past), since
    with poor stub members the controller would run plain steps nearly always."""
    from selfspec.control import ControlConfig, Controller, CostModel

    clock = VirtualClock()
    target, gen, counts = TimedTarget(clock), torch.Generator().manual_seed(0), {}
    ctl = Controller(members, ControlConfig(seed=3), cost=CostModel({1: 1.0, 64: 1.0 + 0.15 * 63}))
    if force:
        choose, steps = ctl.choose, [0]

        def rotated(ctx, *args):
            a, state, budget, cap = choose(ctx, *args)
            steps[0] += 1
            return (a if steps[0] % 2 else (steps[0] // 2) % len(ctl.arms)), state, budget, cap

        ctl.choose = rotated
    if spy is not None:
        assemble = ctl.assemble
        ctl.assemble = lambda plan, results: spy(ctl, assemble(plan, results))
    ids = torch.tensor(PROMPT)
    for _ in range(n):
        out = decode(target, ids, ctl, cfg, gen, NEW, set(), 100, clock=clock)
        key = tuple(out.sequences[0, len(PROMPT):].tolist())
        counts[key] = counts.get(key, 0) + 1
    return counts, ctl


@pytest.mark.parametrize("lossy", [False, "stale bonus", "graft law", "cut by token"])
def test_controller_arms_merges_and_cuts_keep_the_law(lossy, monkeypatch):
    """A controller over a sampling member (one without-replacement child per level, like an
    EAGLE-3 chain: the merge's anchor) and a point-mass one (two children per level), T = 1: plain
    steps, each member alone, the merge (point masses grafted after the anchor's sampled children,
    also under sampled nodes) and the sizing rule's cuts all run, and the law of the first three
    tokens is the target's. Lossy variants of the same harness must fail: a stale bonus token;
    grafted point masses recorded as drawn from their parent's draft law; a cut that drops sampled
    nodes by the token drawn (the bias the sizing rule avoids by cutting point masses only)."""
    from selfspec.control import controller as control_mod

    if lossy == "stale bonus":
        monkeypatch.setattr(verify_mod, "_verify_sampled", _stale_bonus)
    if lossy == "graft law":
        real_merge = control_mod.merge

        def wrong_merge(parts):
            tree, sources = real_merge(parts)
            laws = tree.laws.clone()
            for node in range(1, tree.num_nodes):
                parent = int(tree.parents[node])
                if tree.draft_row is not None and int(tree.draft_row[parent]) >= 0 and laws[node] == Law.POINT:
                    laws[node] = Law.IID
            return DraftTree(tree.tokens, tree.parents, laws, tree.draft_probs, tree.draft_row), sources

        monkeypatch.setattr(control_mod, "merge", wrong_merge)
    if lossy == "cut by token":
        real_size = control_mod.size_tree

        def token_cut(tree, values, verify, fixed, max_nodes, cut_sampled=True):
            keep, rate = real_size(tree, values, verify, fixed, max_nodes, cut_sampled)
            drop = {i for i in range(1, tree.num_nodes) if tree.laws[i] != Law.POINT and int(tree.tokens[i]) % 2}
            for i in sorted(drop):  # a dropped node takes its subtree
                drop |= set(tree.children[i])
            return [i for i in keep if i not in drop], rate

        monkeypatch.setattr(control_mod, "size_tree", token_cut)
    kinds = {"sampled alone": 0, "merged with grafts": 0, "graft under a sampled node": 0, "plain": 0, "cut": 0}

    def spy(ctl, plan):
        tree = plan.tree
        sampled = [i for i in range(1, tree.num_nodes) if tree.laws[i] != Law.POINT]
        grafts = [i for i in range(1, tree.num_nodes) if tree.laws[i] == Law.POINT and sampled]
        kinds["plain"] += tree.num_nodes == 1
        kinds["sampled alone"] += bool(sampled) and not grafts
        kinds["merged with grafts"] += bool(grafts)
        kinds["graft under a sampled node"] += any(int(tree.laws[int(tree.parents[g])]) != Law.POINT for g in grafts)
        kinds["cut"] += plan.tree.num_nodes < plan.drafted
        for g in grafts:  # grafts follow every sibling the anchor drew, and repeat none of their tokens
            siblings = tree.children[int(tree.parents[g])]
            assert max((s for s in siblings if tree.laws[s] != Law.POINT), default=0) < g
            assert sum(int(tree.tokens[s]) == int(tree.tokens[g]) for s in siblings) == 1
        return plan

    cfg = SETTINGS["T1"]
    n = control_samples(SAMPLES) if lossy in ("stale bonus", "graft law") else SAMPLES
    members = [ScriptedDrafter(VOCAB, point=0, sampled=1, law=Law.WOR, seed=1), ScriptedDrafter(VOCAB, point=2, sampled=0, seed=2)]
    counts, ctl = _controller_counts(cfg, members, n, spy=spy)
    assert min(ctl.arm_steps) > 0, ctl.arm_steps
    assert lossy or min(kinds.values()) > 0, kinds
    ok, msg = chi_square_ok(exact_law(cfg), counts, n=n)
    assert ok != bool(lossy), msg


def test_controller_alone_keeps_the_law_with_top_k():
    """One point-mass drafter under the controller's own choices (its two-arm case: plain or
    drafting, cut by the sizing rule), T = 0.7 with top-k 3."""
    cfg = SETTINGS["T0.7-topk3"]
    counts, ctl = _controller_counts(cfg, [ScriptedDrafter(VOCAB, point=3, sampled=0, seed=2)], SAMPLES, force=False)
    assert min(ctl.arm_steps) > 0, ctl.arm_steps
    ok, msg = chi_square_ok(exact_law(cfg), counts)
    assert ok, msg


def test_decode_loop_negative_control_fails(monkeypatch):
    cfg = SETTINGS["T1"]
    monkeypatch.setattr(verify_mod, "_verify_sampled", _stale_bonus)
    n = control_samples(SAMPLES)
    ok, msg = chi_square_ok(exact_law(cfg), draw(cfg, ScriptedDrafter(VOCAB, point=2, sampled=0), n=n), n=n)
    assert not ok, f"the stale-bonus rule passed the exactness test ({msg}): the test is vacuous"


# ---------------------------------------------------------------- the samplers themselves
def _pair_law(p: torch.Tensor) -> dict[tuple[int, int], float]:
    """Exact law of two draws without replacement from ``p``."""
    p = p.double() / p.sum()
    return {(a, b): float(p[a] * p[b] / (1 - p[a])) for a in range(len(p)) for b in range(len(p))
            if a != b and p[a] > 0 and p[b] > 0}


def test_inverse_cdf_draws_follow_the_law_and_never_a_zero_probability_token():
    """``sampling.draw`` (rows of a batch, unnormalised rows, zeros inside and at both ends) and
    ``draw_without_replacement`` (ordered pairs) against their exact laws at 1e-6; a sampler that
    draws the second token from the full law (with replacement) fails the same check."""
    from selfspec.decoding.sampling import draw as draw_rows, draw_without_replacement

    p = torch.tensor([0.0, 0.3, 0.0, 0.05, 0.45, 0.2, 0.0])
    rows = torch.stack([p, 2 * p.flip(0)])  # a second row, unnormalised
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    got = torch.cat([draw_rows(rows.expand(1000, 2, -1).reshape(-1, 7), gen).reshape(1000, 2) for _ in range(n // 1000)])
    for r, law_row in enumerate((p, p.flip(0))):
        counts = torch.bincount(got[:, r], minlength=7)
        law = {(i,): float(law_row[i] / law_row.sum()) for i in range(7) if law_row[i] > 0}
        ok, msg = chi_square_ok(law, {(i,): int(c) for i, c in enumerate(counts) if c}, n=n)
        assert ok, msg
    n_pairs = 60_000
    pairs: dict[tuple[int, int], int] = {}
    for _ in range(n_pairs):
        key = tuple(draw_without_replacement(p, 2, gen))
        pairs[key] = pairs.get(key, 0) + 1
    ok, msg = chi_square_ok(_pair_law(p), pairs, n=n_pairs)
    assert ok, msg
    lossy: dict[tuple[int, int], int] = {}  # negative control: a collision moves on to the next
    support = [i for i in range(7) if p[i] > 0]  # token of the support (distinct and in the support, biased)
    for _ in range(n_pairs):
        a = int(draw_rows(p[None], gen)[0])
        b = int(draw_rows(p[None], gen)[0])
        if b == a:
            b = support[(support.index(a) + 1) % len(support)]
        lossy[(a, b)] = lossy.get((a, b), 0) + 1
    assert set(lossy) <= set(_pair_law(p))
    assert not chi_square_ok(_pair_law(p), lossy, n=n_pairs)[0]
    with pytest.raises(ValueError, match="distinct"):
        draw_without_replacement(p, 5, gen)
    for bad in (torch.zeros(1, 7), torch.tensor([[0.5, float("nan")]]), torch.tensor([[0.5, -0.1, 0.6]])):
        with pytest.raises(ValueError, match="cannot draw"):
            draw_rows(bad, gen)


def test_inverse_cdf_edge_of_the_unit_interval_falls_on_a_positive_token(monkeypatch):
    """A uniform number that rounds the target point up to the total still lands on the last
    token of positive mass, never past it or on a trailing zero."""
    from selfspec.decoding import sampling

    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.ones(a[0], 1, dtype=torch.float64))
    assert sampling.draw(torch.tensor([[0.2, 0.8, 0.0, 0.0]]), torch.Generator()).tolist() == [1]
    monkeypatch.undo()
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.zeros(a[0], 1, dtype=torch.float64))
    assert sampling.draw(torch.tensor([[0.0, 0.0, 0.3, 0.7]]), torch.Generator()).tolist() == [2]
    # a running sum that moves by an ulp across a zero entry (a parallel scan): never that token
    monkeypatch.undo()
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.full((a[0], 1), 0.5, dtype=torch.float64))
    real_cumsum = torch.Tensor.cumsum
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda self, dim: real_cumsum(self, dim) + torch.tensor(
        [0.0, 1e-12, 1e-12, 1e-12], dtype=self.dtype))
    assert sampling.draw(torch.tensor([[0.5, 0.0, 0.5, 0.0]]), torch.Generator()).tolist() == [0]
