"""Sampling: the transform, seeds, and speculative sampling's exactness.

The exactness tests use a 4-token vocabulary, so that the exact joint law of
the first four generated tokens (256 cells) can be computed from the model
and compared with samples by a chi-square test. Seeds are fixed, so every
statistic is deterministic; the thresholds leave wide margins both ways.
"""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs, random_heads, tiny_model
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from clp_mlx.decode import sampling
from clp_mlx.model.backbone import hidden_states, project
from clp_mlx.decode.steps import DecodeStats
from clp_mlx.errors import ClpError
from clp_mlx.decode.sampling import Sampling, accept_drafts, draw, log_probs

V = 4  # vocabulary of the exactness tests
PROMPT = [1, 2, 3, 0]
TEMP = Sampling(temp=1.0)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells expecting < min_expected are pooled."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    x2 = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
    df = len(obs) - 1
    # Wilson-Hilferty: (X2/df)^(1/3) is close to normal; fine for df >= 10.
    z = ((x2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small():
    """A 4-token model with soft distributions, and heads that are partly right."""
    model = tiny_model(0, vocab=V, hidden=16, layers=1, tied=False)
    model.lm_head.weight = model.lm_head.weight * 3.0
    # Strong attention makes every token depend on the whole context, so
    # that a wrong context (a stale draft, a shifted position) shows.
    attn = model.model.layers[0].self_attn
    attn.o_proj.weight = attn.o_proj.weight * 10.0
    mx.eval(model.parameters())
    heads = random_heads(model, 2, seed=1, scale=0.3)
    return model, heads


def conditionals(model, s: Sampling) -> np.ndarray:
    """table[x1, x2, x3] = (4, V): p(x1), p(x2|x1), p(x3|x1 x2), p(x4|x1 x2 x3)."""
    seqs = mx.array([PROMPT + list(t) for t in itertools.product(range(V), repeat=3)])
    lp = log_probs(model(seqs)[:, len(PROMPT) - 1 :], s)
    return np.exp(np.array(lp, dtype=np.float64)).reshape(V, V, V, 4, V)


def exact_joint(table: np.ndarray) -> np.ndarray:
    joint = np.zeros((V,) * 4)
    for x1, x2, x3 in itertools.product(range(V), repeat=3):
        t = table[x1, x2, x3]
        joint[x1, x2, x3] = t[0, x1] * t[1, x2] * t[2, x3] * t[3]
    return joint


def counts_of(samples) -> np.ndarray:
    counts = np.zeros((V,) * 4)
    for s in samples:
        counts[tuple(s)] += 1
    return counts


def decode_samples(model, heads, mode, n, s=TEMP, stats=None, **options):
    """n four-token continuations of PROMPT, seeds 0..n-1, one cache reused."""
    cache = make_prompt_cache(model)
    hidden_states(model, mx.array(PROMPT[:-1]), cache)
    out = []
    for seed in range(n):
        gen = decode_pairs(
            PROMPT[-1:],
            model,
            heads,
            mode=mode,
            max_tokens=4,
            prompt_cache=cache,
            stats=stats,
            sampling=Sampling(s.temp, s.top_p, s.top_k, seed=seed),
            **options,
        )
        out.append([t for t, _ in gen])
        trim_prompt_cache(cache, cache[0].offset - (len(PROMPT) - 1))
    return out


def test_verify_sampling_has_the_backbones_distribution(small):
    model, heads = small
    exact = exact_joint(conditionals(model, TEMP))
    stats = DecodeStats("verify", 2)
    n = 2000
    counts = counts_of(decode_samples(model, heads, "verify", n, stats=stats))
    assert chi2_pvalue(counts, exact) > 1e-3
    # Meaningful only if drafts were both accepted and rejected: the first
    # step of each sample has no drafts and counts as "0 accepted".
    assert stats.accepted[0] > n + 200 and stats.accepted[2] > 200, stats.accepted


def test_verify_sampling_with_chained_heads_has_the_backbones_distribution(small):
    """Chained heads draw each draft from a q that depends on the previous draw."""
    model, _ = small
    heads = random_heads(model, 2, seed=4, scale=0.3, design="chain")
    stats = DecodeStats("verify", 2)
    counts = counts_of(decode_samples(model, heads, "verify", 2000, stats=stats))
    assert chi2_pvalue(counts, exact_joint(conditionals(model, TEMP))) > 1e-3
    assert stats.accepted[1] > 200 and stats.accepted[2] > 100, stats.accepted


def test_ar_sampling_has_the_backbones_distribution(small):
    model, _ = small
    s = Sampling(temp=0.8, top_p=0.9)
    exact = exact_joint(conditionals(model, s))
    counts = counts_of(decode_samples(model, None, "ar", 1000, s=s))
    assert chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("name", ["always accept", "residual from p"])
def test_broken_rule_in_decode_is_detected(small, monkeypatch, name):
    """The decode test above fails when the rule is broken (BROKEN, below)."""
    model, heads = small
    exact = exact_joint(conditionals(model, TEMP))
    monkeypatch.setattr(sampling, *BROKEN[name])
    counts = counts_of(decode_samples(model, heads, "verify", 500))
    assert chi2_pvalue(counts, exact) < 1e-6


def one_step_samples(table, q, n, seed):
    """n runs of the acceptance rule alone, vectorised, with exact p rows.

    x1 is drawn from p; drafts d1, d2 from the heads' q; accept_drafts
    checks them against p(.|x1), p(.|x1 d1), p(.|x1 d1 d2). Positions the
    step leaves open are completed by exact draws, as later steps would.
    """
    tab = mx.array(np.log(np.maximum(table, 1e-30)).astype(np.float32))  # (V,V,V,4,V)
    keys = mx.random.split(mx.random.key(seed), 6)
    x1 = draw(mx.broadcast_to(tab[0, 0, 0, 0], (n, V)), keys[0])
    d = draw(mx.broadcast_to(q[:, None, :], (2, n, V)), keys[1]).T  # (n, 2)
    p = mx.stack([tab[x1, 0, 0, 1], tab[x1, d[:, 0], 0, 2], tab[x1, d[:, 0], d[:, 1], 3]], 1)
    a, tok = accept_drafts(p, mx.broadcast_to(q, (n, 2, V)), d, keys[2])
    x2 = mx.where(a >= 1, d[:, 0], tok)
    x3 = mx.where(a >= 2, d[:, 1], mx.where(a == 1, tok, draw(tab[x1, x2, 0, 2], keys[3])))
    x4 = mx.where(a == 2, tok, draw(tab[x1, x2, x3, 3], keys[4]))
    a, samples = np.array(a), np.array(mx.stack([x1, x2, x3, x4], 1))
    counts = np.zeros((V,) * 4)
    np.add.at(counts, tuple(samples.T), 1)
    return counts, np.bincount(a, minlength=3)


def heads_q(model, heads, s):
    h = hidden_states(model, mx.array(PROMPT), make_prompt_cache(model))[-1:]
    return log_probs(project(model, heads.draft_hidden(h)[0]), s)  # (2, V)


@pytest.mark.parametrize(
    "s",
    # top-p and top-k leave tokens that p allows and q does not, and back.
    [TEMP, Sampling(temp=0.7, top_p=0.8), Sampling(temp=1.5, top_k=2)],
    ids=["temp", "top-p", "top-k"],
)
def test_acceptance_rule_reproduces_p_exactly(small, s):
    model, heads = small
    table = conditionals(model, s)
    counts, accepted = one_step_samples(table, heads_q(model, heads, s), 200_000, seed=0)
    assert chi2_pvalue(counts, exact_joint(table)) > 1e-3
    assert all(accepted > 5_000), accepted  # every acceptance length happened


BROKEN = {
    "always accept": ("acceptance_probability", lambda lp, lq: mx.ones_like(lp)),
    "accept with p(x)": ("acceptance_probability", lambda lp, lq: mx.exp(lp)),
    "accept with q/p": ("acceptance_probability", lambda lp, lq: mx.minimum(1, mx.exp(lq - lp))),
    "residual from p": ("residual", lambda p, q: p),
    "residual from q": ("residual", lambda p, q: q),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_acceptance_rules_are_detected(small, monkeypatch, name):
    model, heads = small
    table = conditionals(model, TEMP)
    monkeypatch.setattr(sampling, *BROKEN[name])
    counts, _ = one_step_samples(table, heads_q(model, heads, TEMP), 200_000, seed=0)
    assert chi2_pvalue(counts, exact_joint(table)) < 1e-6


def test_top_k_one_is_greedy_in_every_mode(model):
    heads = random_heads(model, 3, seed=2, scale=0.5)
    prompt = [5, 17, 99]
    one = Sampling(temp=1.5, top_k=1, seed=0)
    for mode in ("ar", "verify", "fixed", "clp"):
        greedy = [t for t, _ in decode_pairs(prompt, model, heads, mode=mode, max_tokens=30)]
        sampled = [
            t for t, _ in decode_pairs(prompt, model, heads, mode=mode, max_tokens=30, sampling=one)
        ]
        assert sampled == greedy, mode


def test_seed_fixes_the_tokens(small):
    model, heads = small
    for mode in ("ar", "verify", "clp", "gate", "prior-mtp"):

        def run(seed=None, mode=mode):
            s = Sampling(temp=1.0, seed=seed)
            return [
                t for t, _ in decode_pairs([1, 2], model, heads, mode=mode, max_tokens=30, sampling=s)
            ]

        assert run(7) == run(7)
        assert run(7) != run(8), mode
        # Unseeded generations follow mlx's global generator, as in mlx-lm.
        mx.random.seed(3)
        first = run()
        mx.random.seed(3)
        assert run() == first


@pytest.mark.parametrize(
    "temp, top_p, top_k",
    [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 7), (0.5, 1.0, 3), (2.0, 0.95, 40)],
)
def test_transform_keeps_what_mlx_lm_keeps(temp, top_p, top_k):
    mx.random.seed(0)
    logits = mx.random.normal((6, 50)) * 3
    ours = log_probs(logits, Sampling(temp, top_p, top_k))
    ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if top_p < 1:
        ref = apply_top_p(ref, top_p)
    if top_k:
        ref = apply_top_k(ref, top_k)
    ref = ref / temp
    ref = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    assert (mx.isinf(ours) == mx.isinf(ref)).all().item()
    finite = mx.isfinite(ref)
    assert mx.allclose(mx.where(finite, ours, 0), mx.where(finite, ref, 0), atol=1e-5).item()


@pytest.mark.parametrize(
    "kw",
    [{"temp": -1}, {"temp": 1, "top_p": 0}, {"temp": 1, "top_p": 1.5}, {"temp": 1, "top_k": -2}],
)
def test_bad_sampling_values_are_refused(kw):
    with pytest.raises(ClpError):
        Sampling(**kw)
