from itertools import combinations

import pytest

from selfspec.decoding.tree import TreeTemplate
from selfspec.training.tree_search import best_tree, expected_accepted_length

ACC = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.05], [0.4, 0.1, 0.05]]


def test_expected_length_of_a_chain():
    assert expected_accepted_length([(0,), (0, 0)], ACC) == pytest.approx(1 + 0.6 + 0.3)


@pytest.mark.parametrize("budget", [1, 3, 5])
def test_best_tree_beats_every_other_prefix_closed_tree(budget):
    tree = best_tree(ACC, budget)
    assert len(tree.paths) == budget
    best = expected_accepted_length(tree.paths, ACC)
    universe = [p for p in TreeTemplate.full(3, 3).paths]
    for subset in combinations(universe, budget):
        s = set(subset)
        if all(p[:-1] in s or len(p) == 1 for p in subset):
            assert expected_accepted_length(subset, ACC) <= best + 1e-12


def test_best_tree_respects_max_depth():
    assert best_tree(ACC, 6, max_depth=1).depth == 1
