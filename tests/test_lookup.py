"""Context drafts: the n-gram index, its use in training data and in decoding."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs, random_heads, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from clp_mlx.model.backbone import hidden_states, project
from clp_mlx.decode.steps import DecodeStats
from clp_mlx.model.heads import MTPBundle
from clp_mlx.decode.lookup import ContextDrafter, row_drafts


@pytest.mark.parametrize(
    "tokens, drafts, match",
    [
        ([5, 6, 7, 8, 5, 6], [7, 8, 5], 2),  # "5 6" seen before: copy what followed
        ([9, 5, 6, 7, 1, 5, 6], [7, 1, 5], 2),
        ([1, 2, 3, 1, 2, 3, 9, 2, 3], [9, 2, 3], 2),  # the latest earlier "2 3" wins
        ([1, 2, 2, 2], [2, 2, 2], 2),  # a loop of period 1 repeats
        ([3, 4, 3], [4, 3, 4], 1),  # period 2, from a 1-token match
        ([1, 2, 3], [], 0),  # nothing seen before
        ([4], [], 0),  # a suffix never matches itself
    ],
)
def test_drafts_copy_what_followed_the_longest_earlier_match(tokens, drafts, match):
    got = ContextDrafter(tokens, max_ngram=3).propose(3)
    assert got == (drafts, match)


def test_latest_occurrence_of_the_longest_match_is_used():
    # "1 2 3" ... "7 2 3" ... "1 2 3": the 3-gram beats the later 2-gram.
    d = ContextDrafter([1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3], max_ngram=3)
    assert d.propose(2) == ([4, 7], 3)
    assert ContextDrafter([1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3], max_ngram=2).propose(2) == ([5, 1], 2)


def test_extending_equals_building_at_once():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 60).tolist()
    grown = ContextDrafter(seq[:5])
    for i in range(5, 60):
        grown.extend([seq[i]])
        assert grown.propose(4) == ContextDrafter(seq[: i + 1]).propose(4)


def test_row_drafts_match_a_drafter_per_position():
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 5, (3, 30))
    index = rng.permutation(np.concatenate([r * 30 + np.arange(2, 27) for r in range(3)]))[:50]
    drafts, match = row_drafts(rows, index, 3, 2)
    for p, flat in enumerate(index):
        r, t = divmod(int(flat), 30)
        want, n = ContextDrafter(rows[r, : t + 2], max_ngram=2).propose(3)
        assert match[p] == n
        assert drafts[p].tolist() == (want if n else [-1, -1, -1])


def context_heads(model, k=3, lookup=3, seed=1):
    """Wrong heads that use context drafts; CLP set by the caller."""
    noisy = random_heads(model, k, seed=seed, design="chain")
    noisy.config.lookup = lookup
    heads = MTPBundle(noisy.config)
    heads.load_weights(
        [(n, p) for n, p in noisy.parameters().items() if n != "clp_context"]
        + [("clp_context", mx.zeros((lookup + 1, k + 1)))],
        strict=False,
    )
    return heads


def match_length_clp(heads, scale: float):
    """CLP that ignores h and scores run n highest for a match of n tokens."""
    heads.clp.weight = mx.zeros_like(heads.clp.weight)
    heads.clp.bias = mx.zeros_like(heads.clp.bias)
    heads.clp_context = scale * mx.eye(4)
    return heads


def looping_setup():
    model = tiny_model(5, vocab=32, tied=False)  # greedy: loops with variations
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    return model, prompt


@pytest.mark.parametrize("feed", ["all", "clp", "cost"])
def test_verify_with_context_drafts_stays_exact(feed):
    model, prompt = looping_setup()
    ar = [t for t, _ in decode_pairs(prompt, model, mode="ar", max_tokens=48)]
    heads = context_heads(model)
    with_ctx, without = DecodeStats("verify", 3), DecodeStats("verify", 3)
    out = [t for t, _ in decode_pairs(prompt, model, heads, max_tokens=48, stats=with_ctx, feed=feed)]
    assert out == ar
    kw = {"max_tokens": 48, "stats": without, "feed": feed, "lookup": False}
    assert [t for t, _ in decode_pairs(prompt, model, heads, **kw)] == ar
    # A small random model's greedy output loops, so copies pass where the
    # random heads never do.
    assert with_ctx.tokens_per_step > without.tokens_per_step


def test_clp_mode_commits_the_copied_drafts_clp_accepts():
    model, prompt = looping_setup()
    # No match: accept nothing; a match of n tokens: accept n drafts.
    heads = match_length_clp(context_heads(model), 10.0)
    out = [t for t, _ in decode_pairs(prompt, model, heads, mode="clp", max_tokens=40, lookup=True)]
    # The same rule, step by step, recomputing the backbone from scratch.
    seq = list(prompt)
    while len(seq) < len(prompt) + 40:
        h = hidden_states(model, mx.array(seq), make_prompt_cache(model))
        seq.append(mx.argmax(project(model, h[-1:]), axis=-1).item())
        drafts, n = ContextDrafter(seq).propose(3)
        seq += drafts[:n]
    assert out == seq[len(prompt) : len(prompt) + 40]
    assert out != [
        t for t, _ in decode_pairs(prompt, model, heads, mode="clp", max_tokens=40, lookup=False)
    ]


def test_context_lets_a_prefilled_cache_copy_from_the_tokens_it_holds():
    model, prompt = looping_setup()
    heads = match_length_clp(context_heads(model), 10.0)
    kw = {"mode": "clp", "max_tokens": 30, "lookup": True}
    fresh = [t for t, _ in decode_pairs(prompt, model, heads, **kw)]
    cache = make_prompt_cache(model)
    hidden_states(model, mx.array(prompt[:-1]), cache)
    tail = prompt[-1:]
    with_context = decode_pairs(tail, model, heads, prompt_cache=cache, context=prompt[:-1], **kw)
    assert [t for t, _ in with_context] == fresh
    cache = make_prompt_cache(model)
    hidden_states(model, mx.array(prompt[:-1]), cache)
    # Without it, the drafter sees one token: the copies differ, so does the output.
    assert [t for t, _ in decode_pairs(tail, model, heads, prompt_cache=cache, **kw)] != fresh


def test_bench_methods_with_and_without_context_drafts():
    from clp_mlx.bench.run import bench

    model, prompt = looping_setup()
    # Match of length n: CLP's most likely run is n (P = e^2 / (e^2 + 3) = 0.71).
    heads = match_length_clp(context_heads(model), 2.0)
    modes = ["ar", "verify", "verify-heads", "clp-ctx", "clp-ctx@0.99", "clp"]
    table = bench(model, heads, [prompt], modes, max_tokens=40)
    for m in ("verify", "verify-heads"):
        assert table[m]["identical_to_ar"] == 1.0, m
    assert table["verify"]["tokens_per_pass"] > table["verify-heads"]["tokens_per_pass"]
    assert table["clp-ctx"]["tokens_per_pass"] > 1.5
    assert table["clp-ctx@0.99"]["tokens_per_pass"] == 1.0  # P(run >= 1) = 0.9 < 0.99
    assert table["clp"]["tokens_per_pass"] == 1.0  # heads' drafts: row 0, accept none


def test_clp_threshold_takes_the_longest_run_likely_enough():
    from clp_mlx.model.heads import accept_count

    logits = mx.log(mx.array([0.3, 0.1, 0.4, 0.2]))  # P(run >= 1, 2, 3) = 0.7, 0.6, 0.2
    assert accept_count(logits).item() == 2  # the most likely run (the paper's rule)
    got = [accept_count(logits, q).item() for q in (0.1, 0.5, 0.65, 0.9)]
    assert got == [3, 2, 1, 0]
