"""Token trees: the trie, tree attention, the moved cache rows, and exactness."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import random_heads, tiny_model
from mlx_lm.models.cache import make_prompt_cache
from test_decode import prompt_of, run, shift_model
from test_lookup import context_heads, looping_setup

from clp_mlx.native import padrows
from clp_mlx.decode import verify
from clp_mlx.model.backbone import hidden_states, project
from clp_mlx.decode.steps import DecodeStats
from clp_mlx.errors import ClpError
from clp_mlx.decode.lookup import ContextDrafter
from clp_mlx.decode.tree import Tree, keep_path, tree_hidden_states


def test_trie_merges_prefixes_and_stops_at_its_size():
    t = Tree.build(7, [[1, 2, 3], [1, 4], [5, 6, 7], [8]], size=7)
    assert t.tokens == [7, 1, 2, 3, 4, 5, 6]  # [1, 4] shares its 1; [5, 6, 7] loses its 7
    assert t.parents == [-1, 0, 1, 2, 1, 0, 5]
    assert t.depths == [0, 1, 2, 3, 2, 1, 2]
    assert t.path(4) == [0, 1, 4] and t.path(0) == [0]
    assert not t.is_chain() and Tree.build(7, [[1, 2]], 9).is_chain()
    anc = t.ancestors()
    assert anc[6].tolist() == [True, False, False, False, False, True, True]
    assert anc.sum() == sum(d + 1 for d in t.depths)


def test_context_candidates_latest_and_longest_first():
    d = ContextDrafter([1, 2, 3, 9, 1, 2, 4, 5, 2, 6, 1, 2])
    # "1 2" ended at 5 (-> 4 5 2) and at 1 (-> 3 9 1); then "2" alone adds 6 1 2.
    assert d.candidates(3, 10) == [[4, 5, 2], [3, 9, 1], [6, 1, 2]]
    assert d.candidates(3, 10)[0] == d.propose(3)[0]
    assert d.candidates(3, 2) == [[4, 5, 2], [3, 9, 1]]
    assert ContextDrafter([1, 2, 3]).candidates(3, 5) == []


@pytest.mark.parametrize("tied", [True, False])
def test_each_node_sees_only_its_own_path(tied):
    model = tiny_model(2, tied=tied)
    prompt = mx.array(prompt_of(9, 4))
    t = Tree.build(11, [[5, 6, 7], [5, 9], [20, 21, 22], [30]], size=16)
    cache = make_prompt_cache(model)
    hidden_states(model, prompt, cache)
    got = tree_hidden_states(model, t, cache)
    assert cache[0].offset == prompt.size + len(t)
    for node in range(len(t)):
        path = mx.array([t.tokens[i] for i in t.path(node)])
        fresh = make_prompt_cache(model)
        hidden_states(model, prompt, fresh)
        want = hidden_states(model, path, fresh)[-1]
        np.testing.assert_allclose(np.array(got[node]), np.array(want), rtol=1e-4, atol=1e-4)


def test_kept_path_leaves_the_cache_of_the_committed_tokens():
    model = tiny_model(1)
    prompt = mx.array(prompt_of(6, 8))
    t = Tree.build(3, [[5, 6, 7], [8, 9, 10], [8, 12]], size=16)
    for node in (0, 2, 3, 5, 6, 7):
        cache = make_prompt_cache(model)
        hidden_states(model, prompt, cache)
        start = cache[0].offset
        tree_hidden_states(model, t, cache)
        path = t.path(node)
        keep_path(cache, start, path, len(t))
        assert cache[0].offset == start + len(path)
        probe = mx.array([42, 7])
        after = project(model, hidden_states(model, probe, cache))
        fresh = make_prompt_cache(model)
        kept = mx.array([t.tokens[i] for i in path])
        hidden_states(model, mx.concatenate([prompt, kept]), fresh)
        want = project(model, hidden_states(model, probe, fresh))
        np.testing.assert_allclose(np.array(after), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_tree_verify_equals_ar_for_random_heads(k):
    for seed in range(3):
        model = tiny_model(seed, tied=seed % 2 == 0)
        for n in (1, 9):
            prompt = prompt_of(n, seed * 31 + n)
            ar = run(prompt, model, mode="ar", max_tokens=40)
            for design in ("medusa", "chain"):
                heads = random_heads(model, k, seed=seed + n, scale=0.5, design=design)
                for feed in ("all", "cost"):
                    got = run(prompt, model, heads, max_tokens=40, tree=16, feed=feed)
                    assert got == ar, (k, seed, n, design, feed)


def test_tree_finds_the_right_copy_behind_a_wrong_one():
    """Greedy continues 8 with 9 10 11 ...; the context's latest "7 8" is
    followed by 60 61 (wrong), an earlier one by 9 10 11 (right)."""
    model, heads = shift_model(vocab=64, k=3)
    heads.heads = [lambda h, i=i: mx.roll(h, 20 + i, axis=-1) for i in range(1, 4)]  # wrong
    heads.use_context(3)
    prompt = [7, 8, 9, 10, 11, 50, 7, 8, 60, 61, 7]
    ar = run(prompt, model, mode="ar", max_tokens=20)
    assert ar[:4] == [8, 9, 10, 11]
    stats = {}
    for size in (0, 16):
        stats[size] = DecodeStats("verify", 3)
        got = run(prompt, model, heads, max_tokens=20, tree=size, feed="all", stats=stats[size])
        assert got == ar, size
    # The chain feeds the latest copy and loses; the tree also feeds the earlier one.
    assert stats[0].accepted[3] == 0 and stats[16].accepted[3] >= 1
    assert stats[16].tokens_per_step > stats[0].tokens_per_step


def test_one_tree_branch_feeds_the_heads_drafts_as_a_chain(model):
    prompt = prompt_of(9, 5)
    ar = run(prompt, model, mode="ar", max_tokens=30)
    heads = random_heads(model, 3, seed=2, scale=0.5, design="chain")
    fed = []
    original = verify.one_pass

    def spy(model, drafter, t, cache):
        fed.append((t.is_chain(), drafter.width))
        return original(model, drafter, t, cache)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "one_pass", spy)
        for branches in (5, 1):
            heads.config.tree_branches = branches
            fed.clear()
            assert run(prompt, model, heads, max_tokens=30, tree=16, feed="all") == ar
            trees = [w for chain, w in fed if not chain]
            assert (len(trees) > 0) == (branches > 1), branches
            assert {w for _, w in fed} == {branches}


def test_trees_by_default_only_where_wide_passes_are_padded():
    model, prompt = looping_setup()
    heads = context_heads(model)
    ar = run(prompt, model, mode="ar", max_tokens=40)
    calls = []
    original = verify.one_pass

    def spy(model, drafter, fed, *a, **kw):
        if not fed.is_chain():
            calls.append(len(fed))
        return original(model, drafter, fed, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "one_pass", spy)
        assert run(prompt, model, heads, max_tokens=40, feed="all") == ar
        assert not calls
        padrows.pad_rows(model, force=True)
        assert run(prompt, model, heads, max_tokens=40, feed="all") == ar
        assert calls and max(calls) <= padrows.ROWS
        calls.clear()
        assert run(prompt, model, heads, max_tokens=40, feed="all", tree=0) == ar
        assert not calls


def test_a_negative_tree_is_refused(model):
    heads = random_heads(model, 2, seed=0)
    with pytest.raises(ClpError, match="tree must be 0"):
        run([1, 2], model, heads, tree=-1)


def test_a_draft_vocabulary_smaller_than_the_trees_branches(model):
    prompt = prompt_of(9, 5)
    ar = run(prompt, model, mode="ar", max_tokens=20)
    heads = random_heads(model, 3, seed=2, scale=0.5, design="chain")
    heads.set_draft_vocab([3, 7])  # 2 tokens; a 16-token tree asks head 1 for 5 branches
    assert run(prompt, model, heads, max_tokens=20, tree=16, feed="all") == ar
