"""The decode step: one function advances a set of requests by one target pass.

Every way of decoding (``selfspec.generate`` on one prompt or several, ``stream``,
``custom_generate``, :class:`selfspec.batch.Pool`) runs :func:`step` on the requests a
:class:`~selfspec.model.target.Target` holds:

1. **draft**: each request's controller plans its arm (:meth:`~selfspec.control.Controller.plan`);
   every member drafts for all the rows that asked it in one
   :meth:`~selfspec.drafters.base.Drafter.propose_many` call; each controller assembles its tree;
   with several rows the batch picks one node budget (:mod:`selfspec.control.budget`). A request
   with nothing to draft verifies a root-only tree: a plain step, the same pass plain decoding runs.
2. **pass**: the target scores every row's tree in one forward.
3. **verify**: per request, its constraint and processors at every node, the pure verifier with
   its own settings and generator, then its new tokens (EOS, stopping criteria).
4. **commit**: every row's accepted path into the target's cache.
5. **advance**: per request, its tokens, stats, streamer and controller observation.

Fault isolation: an exception raised by one request's own code (its drafter, constraint,
processors, stopping criteria, streamer) ends that request with the error
(:meth:`~selfspec.decoding.request.Request.fail`): its row commits nothing (``[]``: its cache slots roll
back) and every other row's step is exactly what it would have been. An exception in the pass
itself rolls every row back (:meth:`~selfspec.model.target.Target.rollback`) and propagates: no
request has changed, so the step can be run again.

Exactness: a request's output depends only on its own prompt, settings, generator and its nodes'
logits (see :mod:`selfspec.decoding.request`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..control.budget import node_budget
from .request import Request
from .tree import DraftTree


@dataclass
class StepReport:
    """What one step did (seconds on the caller's clock).

    Attributes:
        trees: each row's verified tree; ``emitted``: tokens the rows committed in all.
        draft_s: each row's drafting seconds (its controller's deciding included); ``pass_s``,
            ``verify_s``, ``commit_s``: the pass, the rows' verification, the cache commit.
        drafting: whether rows were allowed to draft.
    """

    trees: list[DraftTree]
    emitted: int = 0
    draft_s: list[float] = field(default_factory=list)
    pass_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    drafting: bool = True


def sync(device) -> None:
    """Wait for queued CUDA work before reading a clock."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def step(target, requests: list[Request], clock, *, cost=None, drafting: bool = True,
         budget: bool = False) -> StepReport:
    """Advance ``requests`` (row b of ``target`` is ``requests[b]``, none finished) by one step.

    Args:
        target: a :class:`~selfspec.model.target.Target` holding exactly these rows.
        clock: seconds (the controllers' timings are read off it).
        cost: the controllers' shared :class:`~selfspec.control.CostModel`, told the pass's
            seconds (``None``: no controller).
        drafting: ``False`` runs a plain step for every row (no controller asked).
        budget: pick one node budget for every row's tree (:mod:`selfspec.control.budget`).
    """
    rows = len(requests)
    try:
        trees, plans, draft_s, handoffs = _draft(target, requests, clock, drafting, budget)
    except BaseException:
        target.rollback()
        raise
    t1 = clock()
    try:
        scored = target.forward_trees(trees, handoffs if any(h is not None for h in handoffs) else None)
        sync(target.device)
    except BaseException:
        target.rollback()
        raise
    t2 = clock()
    paths, taken, verdicts = [], [], []
    for req, tree, out in zip(requests, trees, scored):
        verdict = got = None
        if req.error is None:
            try:
                verdict = req.settle(tree, out.logits)
                got = req.take(tree, verdict)
            except Exception as err:
                req.fail(err)
        verdicts.append(verdict)
        taken.append(got)
        paths.append(verdict.path if got is not None else [])
    t3 = clock()
    target.commit(paths)
    sync(target.device)
    t4 = clock()
    nodes = max(t.num_nodes for t in trees)
    share = (t4 - t1) / rows
    if cost is not None:
        cost.record_verify(nodes, share, rows)
    report = StepReport(trees, 0, draft_s, t2 - t1, t3 - t2, t4 - t3, drafting)
    interrupt = None
    for req, tree, verdict, got, plan, out, d in zip(requests, trees, verdicts, taken, plans, scored, draft_s):
        if got is None:
            continue
        try:
            report.emitted += len(req.advance(tree, verdict, got, plan, out.hidden, out.taps, d, share, t4))
        except Exception as err:
            req.fail(err)
        except BaseException as err:  # every row still advances; then the interrupt goes on
            req.fail(err)
            interrupt = interrupt or err
        if req.error is None:
            req.check_budget()
    if interrupt is not None:
        raise interrupt
    return report


def _draft(target, requests: list[Request], clock, drafting: bool, budget: bool):
    """``(trees, plans, seconds, handoffs)`` per row: its controller plans, the members draft for
    every row that asked them in one :meth:`~selfspec.drafters.base.Drafter.propose_many` call
    (its seconds shared evenly; one row asks ``propose``), and each controller assembles its tree. A row whose drafting
    raised is failed and verifies a root-only tree (its row commits nothing)."""
    rows = len(requests)
    cache = target.cache if rows == 1 and target.supports_handoff else None
    plans: list = [None] * rows
    seconds = [0.0] * rows
    calls: dict[int, list] = {}
    for b, req in enumerate(requests):
        t = clock()
        try:
            share = cache if req.controller is not None and req.controller.requires.target_cache else None
            ctx = req.context(share, drafting)
            plans[b] = None if ctx is None else req.controller.plan(ctx, rows)
        except Exception as err:
            req.fail(err)
        seconds[b] += clock() - t
        for m, mctx in plans[b].calls if plans[b] is not None and req.error is None else ():
            calls.setdefault(m, []).append((b, mctx))
    results: list[list] = [[] for _ in requests]
    for m, asked in sorted(calls.items()):
        drafters = [requests[b].controller.members[m] for b, _ in asked]
        # (a retry of several rows draws each row's same draft coins; one row is never retried)
        coins = [mctx.generator.get_state() for _, mctx in asked] if len(asked) > 1 else None
        t = clock()
        try:
            if len(asked) == 1:
                proposals = [drafters[0].propose(asked[0][1])]
            else:
                proposals = type(drafters[0]).propose_many(drafters, [mctx for _, mctx in asked])
            spent = [(clock() - t) / len(asked)] * len(asked)
        except Exception as err:
            if len(asked) == 1:
                requests[asked[0][0]].fail(err)
                proposals, spent = [None], [clock() - t]
            else:  # find whose drafter raised: each row alone, from the coins it had
                proposals, spent = [], []
                for (b, mctx), d, state in zip(asked, drafters, coins):
                    mctx.generator.set_state(state)
                    t = clock()
                    try:
                        proposals.append(d.propose(mctx))
                    except Exception as row_err:
                        requests[b].fail(row_err)
                        proposals.append(None)
                    spent.append(clock() - t)
        for (b, _), proposal, s in zip(asked, proposals, spent):
            results[b].append((m, proposal, s))
    trees, handoffs = [], []
    for b, (req, plan) in enumerate(zip(requests, plans)):
        tree, handoff = None, None
        if plan is not None and req.error is None:
            t = clock()
            try:
                order = {m: i for i, (m, _) in enumerate(plan.calls)}
                got = sorted(results[b], key=lambda r: order[r[0]])
                req.controller.assemble(plan, [(p, s) for _, p, s in got])
                tree, handoff = plan.tree, plan.handoff
            except Exception as err:
                req.fail(err)
            seconds[b] += clock() - t + sum(s for _, _, s in results[b])
        if tree is None:
            tree = DraftTree.root_only(int(req.tokens[req.length - 1]))
            plans[b] = plan if req.error is None else None
            if cache is not None and req.error is not None:  # its drafter may have written the target's cache
                target.rollback()
        trees.append(tree)
        handoffs.append(handoff)
    if budget and rows > 1:
        trees = _cut(requests, plans, trees, sum(seconds))
    return trees, plans, seconds, handoffs


def _cut(requests: list[Request], plans: list, trees: list[DraftTree], draft_s: float) -> list[DraftTree]:
    """Every row's tree cut to the batch's one node budget (:mod:`selfspec.control.budget`)."""
    offers = [r.controller.offer(p) if p is not None and t.num_nodes > 1 else None
              for r, p, t in zip(requests, plans, trees)]
    cost = next((r.controller.cost for r in requests if r.controller is not None), None)
    if cost is None:
        return trees
    n = node_budget(offers, [t.num_nodes - 1 for t in trees], draft_s, cost.verify)
    if n is None:
        return trees
    return [r.controller.cut(p, n) if o and t.num_nodes - 1 > n else t
            for r, p, t, o in zip(requests, plans, trees, offers)]
