"""Distribution equality at T > 0 (shared/docs/EXACTNESS.md).

The law of the first three generated tokens is enumerated exactly from a table-driven target with a
6-token vocabulary, then compared with many speculative samples drawn through the real decode loop
with deliberately poor drafts (point-mass, i.i.d. and without-replacement children) so that
acceptances, recoveries and bonus tokens all occur. Pearson chi-square at a 1e-6 false-failure
rate; cells with expected count < 5 are pooled; any sample outside the support fails. Negative
controls run the same harness with lossy rules and must fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

import selfspec.verify as verify_mod
from selfspec.engine import decode
from selfspec.sampling import SamplingConfig, target_probs
from selfspec.tree import Law
from stubs import ScriptedDrafter, table_target

VOCAB, PROMPT, NEW, SAMPLES = 6, [1, 2], 3, 20000


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
    for _ in range(n):
        out = decode(target, ids, drafter, cfg, gen, NEW, set(), 100)
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


SETTINGS = {
    "T1": SamplingConfig(1.0),
    "T0.7-topk3": SamplingConfig(0.7, top_k=3),
    "T1.3-topp0.8": SamplingConfig(1.3, top_p=0.8),
}
DRAFTS = {
    "point": dict(point=2, sampled=0),
    "iid": dict(point=0, sampled=3, law=Law.IID),
    "wor": dict(point=0, sampled=3, law=Law.WOR),
    "mixed": dict(point=1, sampled=2, law=Law.WOR),
}
CASES = [("T1", "point"), ("T0.7-topk3", "iid"), ("T1.3-topp0.8", "wor"), ("T0.7-topk3", "mixed")]


@pytest.mark.parametrize("setting,draft", CASES)
def test_speculative_law_equals_target_law(setting, draft):
    cfg = SETTINGS[setting]
    ok, msg = chi_square_ok(exact_law(cfg), draw(cfg, ScriptedDrafter(VOCAB, **DRAFTS[draft])))
    assert ok, msg


def test_plain_decoding_law_equals_target_law():
    cfg = SETTINGS["T1.3-topp0.8"]
    ok, msg = chi_square_ok(exact_law(cfg), draw(cfg, None, n=SAMPLES // 2), n=SAMPLES // 2)
    assert ok, msg


def _wor_treated_as_iid(tree, child, earlier, like):
    """Pitfall 1: reuse q after a rejection for children drawn without replacement."""
    parent = int(tree.parents[child])
    if int(tree.laws[child]) == Law.POINT:
        return torch.nn.functional.one_hot(tree.tokens[child], like.shape[-1]).to(like)
    return tree.draft_probs[int(tree.draft_row[parent])].to(like)


def _stale_bonus(tree, probs, generator):
    """Pitfall 5: the bonus token drawn from the parent's law instead of the leaf's full p."""
    verdict = _exact_sampled(tree, probs, generator)
    if verdict.bonus and len(verdict.path) > 1:
        parent = verdict.path[-2]
        return verify_mod.Verdict(verdict.path, verify_mod.sample(probs[parent], generator), True)
    return verdict


_exact_sampled = verify_mod._verify_sampled


@pytest.mark.parametrize("lossy", ["wor_as_iid", "stale_bonus"])
def test_negative_controls_fail(monkeypatch, lossy):
    cfg = SETTINGS["T1"]
    if lossy == "wor_as_iid":
        monkeypatch.setattr(verify_mod, "_child_law", _wor_treated_as_iid)
        drafter = ScriptedDrafter(VOCAB, point=0, sampled=3, law=Law.WOR)
    else:
        monkeypatch.setattr(verify_mod, "_verify_sampled", _stale_bonus)
        drafter = ScriptedDrafter(VOCAB, point=2, sampled=0)
    ok, msg = chi_square_ok(exact_law(cfg), draw(cfg, drafter))
    assert not ok, f"the lossy rule {lossy} passed the exactness test ({msg}): the test is vacuous"
