"""Tree-logits equivalence: one tree pass equals a plain causal pass over prefix + path, for every
node, before and after KV compaction, on tiny float64 models of each supported family (the
sliding-window families with a prefix longer than the window)."""

from __future__ import annotations

import pytest
import torch

from selfspec.model.target import TreeTarget
from selfspec.decoding.tree import TreeBuilder
from tiny_models import FAMILIES, tiny_model


def _tree(root: int):
    b = TreeBuilder(root)
    a, c = b.add(0, 5), b.add(0, 7)
    d = b.add(a, 9)
    e = b.add(d, 11)
    b.add(c, 3)
    b.add(a, 2)
    return b.build(), e


def _reference(model, seq: torch.Tensor) -> torch.Tensor:
    return model(seq[None]).logits[0, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_node_matches_sequential_logits(family):
    model = tiny_model(family)
    prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(3))
    target = TreeTarget(model, want_hidden=True)
    target.prefill(prompt)
    tree, deep = _tree(int(prompt[-1]))
    prefix = target.prefix_len
    assert prefix == 11
    out = target.forward_tree(tree)
    for node in range(tree.num_nodes):
        path = tree.tokens[tree.path_to(node)]
        seq = torch.cat([prompt[:-1], path])
        torch.testing.assert_close(out.logits[node], _reference(model, seq), rtol=0, atol=1e-10)
        hidden = model(seq[None], output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(out.hidden[node], hidden, rtol=0, atol=1e-10)

    # compact to the deepest branch, then a second tree on top of the compacted cache
    path = tree.path_to(deep)
    target.commit([path])
    assert target.prefix_len == prefix + len(path)
    committed = torch.cat([prompt[:-1], tree.tokens[path]])
    tree2, _ = _tree(17)
    out2 = target.forward_tree(tree2)
    for node in range(tree2.num_nodes):
        seq = torch.cat([committed, tree2.tokens[tree2.path_to(node)]])
        torch.testing.assert_close(out2.logits[node], _reference(model, seq), rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_chain_prefix_commit_crops(family):
    model = tiny_model(family)
    prompt = torch.arange(1, 9)
    target = TreeTarget(model)
    target.prefill(prompt)
    b = TreeBuilder(8)
    n1 = b.add(0, 4)
    b.add(n1, 6)
    b.add(0, 3)
    tree = b.build()
    target.forward_tree(tree)
    target.commit([[0, 1]])  # root + first child: a chain prefix
    assert target.prefix_len == 9
    b2 = TreeBuilder(30)
    out = target.forward_tree(b2.build())
    seq = torch.cat([prompt, torch.tensor([4, 30])])
    torch.testing.assert_close(out.logits[0], _reference(model, seq), rtol=0, atol=1e-10)


def test_unknown_layer_type_is_refused():
    model = tiny_model("qwen3")
    model.config.layer_types = ["chunked_attention"] * 2
    with pytest.raises(ValueError, match="chunked_attention"):
        TreeTarget(model)


def test_own_lm_head_shortcut_only_when_it_matches_the_forward():
    from selfspec.model.lm_head import head_matches_forward

    for family in FAMILIES:  # gemma3 soft-caps its logits: the shortcut must reproduce that
        assert head_matches_forward(tiny_model(family)), family

    class Scaled(type(tiny_model("llama"))):
        """A model whose forward post-processes logits in a way selfspec does not know."""

        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    model = Scaled(tiny_model("llama").config).double().eval()
    assert not head_matches_forward(model)
    target = TreeTarget(model)
    assert target.decoder is None
    prompt = torch.arange(1, 9)
    target.prefill(prompt)
    tree, _ = _tree(8)
    out = target.forward_tree(tree)
    seq = torch.cat([prompt[:-1], tree.tokens[tree.path_to(3)]])
    torch.testing.assert_close(out.logits[3], _reference(model, seq), rtol=0, atol=1e-10)
