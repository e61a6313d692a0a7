"""The decode step: lossless verify, oracle heads, cache trims, bad input."""

import itertools
import json

import mlx.core as mx
import pytest
from conftest import decode_pairs, FakeTokenizer, random_heads, tiny_model
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from clp_mlx.model.backbone import hidden_states, project
from clp_mlx.decode.steps import DecodeStats
from clp_mlx.errors import ClpError
from clp_mlx.api import stream_generate
from clp_mlx.model.heads import MTPBundle
from clp_mlx.model.heads_files import init_heads


def run(prompt, model, heads=None, **kw):
    return [t for t, _ in decode_pairs(prompt, model, heads, **kw)]


def prompt_of(n, seed, vocab=128):
    mx.random.seed(seed)
    return mx.random.randint(0, vocab, (n,)).tolist()


def test_ar_equals_mlx_lm_generate_step(model):
    for seed, n in [(1, 1), (2, 5), (3, 17)]:
        prompt = prompt_of(n, seed)
        ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
        assert run(prompt, model, mode="ar", max_tokens=40) == ref


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verify_equals_ar_for_random_heads(k):
    # Two models per k (one tied, one not), eight across the four k's.
    for seed in (2 * k - 2, 2 * k - 1):
        model = tiny_model(seed, tied=seed % 2 == 0)
        for n in (1, 3, 9):
            prompt = prompt_of(n, seed * 31 + n)
            ar = run(prompt, model, mode="ar", max_tokens=48)
            for design in ("medusa", "embed", "chain"):
                heads = random_heads(model, k, seed=seed + n, scale=0.5, design=design)
                got = run(prompt, model, heads, mode="verify", max_tokens=48)
                assert got == ar, (k, seed, n, design)


class NoisyOracle(MTPBundle):
    """Heads that look the true future up, then get a share of it wrong.

    The backbone's output rows are orthonormal, so a head can write token x
    by returning x's row. Each hidden state is matched to the nearest one
    seen on the greedy path, whose future is known; rows off that path (after
    a wrong draft) get whatever their neighbour had, as real heads would.
    """

    def setup(self, model, prompt, continuation, p_wrong, seed):
        seq = mx.array(prompt + continuation)
        self.table = hidden_states(model, seq, make_prompt_cache(model))
        k, n, vocab = self.k, seq.size, model.args.vocab_size
        future = [[int(seq[min(p + 1 + i, n - 1)]) for i in range(1, k + 1)] for p in range(n)]
        mx.random.seed(seed)
        wrong = (mx.random.uniform(shape=(n, k)) < p_wrong).tolist()
        self.targets = mx.array(
            [[(t + 1) % vocab if w else t for t, w in zip(f, ws)] for f, ws in zip(future, wrong)]
        )
        self.out_rows = model.lm_head.weight * 10.0

    def draft_hidden(self, h, tok_emb=None):
        dist = mx.sum((h[:, None, :] - self.table[None]) ** 2, axis=-1)
        return self.out_rows[self.targets[mx.argmin(dist, axis=-1)]]


def orthonormal_output(model):
    q, _ = mx.linalg.qr(
        mx.random.normal((model.args.hidden_size, model.args.vocab_size)), stream=mx.cpu
    )
    model.lm_head.weight = q.T
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("k", [1, 2, 4])
def test_verify_equals_ar_when_heads_are_partly_right(k):
    accepted = [0] * (k + 1)
    for seed in range(4):
        model = orthonormal_output(tiny_model(seed, vocab=48, tied=False))
        for n in (1, 6):
            prompt = prompt_of(n, seed * 7 + n, vocab=48)
            ar = run(prompt, model, mode="ar", max_tokens=40)
            heads = NoisyOracle(init_heads(model, k).config)
            heads.setup(model, prompt, ar, p_wrong=0.25, seed=seed)
            stats = DecodeStats("verify", k)
            assert run(prompt, model, heads, mode="verify", max_tokens=40, stats=stats) == ar
            accepted = [a + b for a, b in zip(accepted, stats.accepted)]
    # The check is only meaningful if every acceptance length happened.
    assert all(c > 0 for c in accepted), accepted


def test_verify_equals_ar_with_fresh_heads_and_fewer_drafts(model):
    heads = init_heads(model, 4, seed=0)
    prompt = prompt_of(6, 7)
    ar = run(prompt, model, mode="ar", max_tokens=40)
    for m in (1, 2, 4):
        assert run(prompt, model, heads, mode="verify", max_tokens=40, num_draft_tokens=m) == ar


def shift_model(vocab=64, k=3):
    """A backbone whose greedy next token is (t + 1) % vocab, and oracle heads.

    Attention and MLP outputs are zeroed, so the last hidden state is the
    (normed) one-hot embedding of the current token; the untied output layer
    maps token t's direction to t + 1. Head i applies that shift i more times:
    it copies the backbone's future exactly.
    """
    model = tiny_model(0, vocab=vocab, hidden=vocab, tied=False)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    eye = mx.eye(vocab)
    shift = mx.roll(eye, 1, axis=0)  # shift @ e_t = e_{t+1}
    model.model.embed_tokens.weight = eye * 3.0
    model.lm_head.weight = shift
    mx.eval(model.parameters())

    heads = init_heads(model, k, seed=0)

    class Shift:
        def __init__(self, times):
            self.m = mx.roll(eye, times, axis=0)

        def __call__(self, h):
            return h @ self.m.T

    heads.heads = [Shift(i) for i in range(1, k + 1)]
    heads.clp.weight = mx.zeros_like(heads.clp.weight)
    heads.clp.bias = mx.array([0.0] * k + [5.0])  # CLP: accept all k
    return model, heads


def test_oracle_heads_fully_accepted_and_reproduce_ar():
    k = 3
    model, heads = shift_model(k=k)
    prompt = [5, 9, 2]
    ar = run(prompt, model, mode="ar", max_tokens=30)
    assert ar == [(2 + i) % 64 for i in range(1, 31)]
    for mode in ("verify", "fixed", "clp"):
        stats = DecodeStats(mode, k)
        assert run(prompt, model, heads, mode=mode, max_tokens=30, stats=stats) == ar, mode
        # 30 tokens, k+1 per pass: every step but the first (verify has no
        # drafts yet) and the last (cut by max_tokens) accepts all k.
        full = stats.accepted[k]
        assert full >= stats.steps - 2, (mode, stats.accepted)
    assert stats.tokens_per_step > 3.5


def test_eos_and_max_tokens_at_every_offset_inside_a_step(model):
    k = 3
    heads = random_heads(model, k, seed=3, scale=0.3)
    prompt = prompt_of(4, 11)
    ar = run(prompt, model, mode="ar", max_tokens=30)
    for max_tokens in range(1, 30):
        got = run(prompt, model, heads, mode="verify", max_tokens=max_tokens)
        assert got == ar[:max_tokens]
        for mode in ("fixed", "clp"):
            assert len(run(prompt, model, heads, mode=mode, max_tokens=max_tokens)) == max_tokens
    # Oracle heads put EOS inside a multi-token step at every offset.
    omodel, oheads = shift_model(k=k)
    oracle_ar = run([0], omodel, mode="ar", max_tokens=20)
    for stop_at in range(1, 12):
        eos = oracle_ar[stop_at]
        for mode in ("ar", "verify", "fixed"):
            tok = FakeTokenizer(eos=[eos])
            rs = list(stream_generate(omodel, tok, [0], oheads, mode=mode, max_tokens=20))
            assert rs[-1].finish_reason == "stop"
            assert tok.detokenizer.tokens == oracle_ar[:stop_at], (mode, stop_at)


def test_trimmed_cache_gives_the_logits_of_a_cache_of_committed_tokens(model):
    prompt = mx.array(prompt_of(7, 5))
    extra = mx.array([3, 14, 15, 92])
    for n_trim in range(1, 5):
        cache = make_prompt_cache(model)
        hidden_states(model, mx.concatenate([prompt, extra]), cache)
        trim_prompt_cache(cache, n_trim)
        kept = extra[: extra.size - n_trim]
        probe = mx.array([42, 7])
        after_trim = project(model, hidden_states(model, probe, cache))

        fresh = make_prompt_cache(model)
        hidden_states(model, mx.concatenate([prompt, kept]), fresh)
        reference = project(model, hidden_states(model, probe, fresh))
        assert mx.allclose(after_trim, reference, atol=1e-5, rtol=1e-5).item()


def test_modes_commit_what_they_promise(model):
    k = 2
    heads = random_heads(model, k, seed=1)
    prompt = prompt_of(3, 2)
    for mode in ("clp", "fixed", "gate", "prior-mtp"):
        stats = DecodeStats(mode, k)
        out = run(prompt, model, heads, mode=mode, max_tokens=25, stats=stats)
        assert len(out) == 25 and stats.tokens == 25
        assert sum(stats.accepted) == stats.steps
    stats = DecodeStats("fixed", k)
    run(prompt, model, heads, mode="fixed", max_tokens=31, stats=stats)
    assert stats.accepted[k] == stats.steps - 1  # all but the step cut short


def test_clp_parameter_count(model):
    for k in (1, 2, 4):
        heads = init_heads(model, k)
        assert heads.clp_param_count() == 64 * (k + 1) + (k + 1)


def test_gate_has_about_a_million_parameters():
    from mlx.utils import tree_flatten

    from clp_mlx.model.heads import Gate, gate_hidden_size

    for d, k in itertools.product((896, 1536), (2, 4)):
        gate = Gate(d, k, gate_hidden_size(d, k))
        n = sum(p.size for _, p in tree_flatten(gate.parameters()))
        assert 0.99e6 < n < 1.01e6


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(prompt=[]), "empty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(mode="nope"), "unknown mode"),
        (dict(mode="clp", heads=None), "needs heads"),
            (dict(mode="verify", heads=None, lookup=False), "only from the context"),
            (dict(mode="verify", heads=None, num_draft_tokens=16), "draft_len"),
        (dict(mode="verify", num_draft_tokens=0), "draft_len"),
        (dict(mode="verify", num_draft_tokens=5), "draft_len"),
    ],
)
def test_bad_input_gives_clear_errors(model, kw, message):
    args = dict(prompt=[1, 2], heads=init_heads(model, 2), mode="ar", max_tokens=5)
    args.update(kw)
    with pytest.raises(ClpError, match=message):
        list(decode_pairs(args.pop("prompt"), model, args.pop("heads"), **args))


def test_k_below_one_is_refused(model):
    with pytest.raises(ClpError, match="at least 1"):
        init_heads(model, 0)


def test_draft_vocabulary_keeps_verify_exact_and_limits_drafts(model):
    heads = random_heads(model, 3, seed=8, scale=0.3)
    heads.set_draft_vocab(list(range(0, 128, 3)))
    prompt = prompt_of(5, 13)
    ar = run(prompt, model, mode="ar", max_tokens=30)
    assert run(prompt, model, heads, mode="verify", max_tokens=30) == ar
    drafted = [
        t
        for t, from_draft in decode_pairs(prompt, model, heads, mode="fixed", max_tokens=30)
        if from_draft
    ]
    assert drafted and all(t % 3 == 0 for t in drafted)


def partly_right_setup(k=3):
    """A model, a prompt, its ar output and k noisy-oracle heads (25% wrong)."""
    model = orthonormal_output(tiny_model(3, vocab=48, tied=False))
    prompt = prompt_of(4, 21, vocab=48)
    ar = run(prompt, model, mode="ar", max_tokens=40)
    heads = NoisyOracle(init_heads(model, k).config)
    heads.setup(model, prompt, ar, p_wrong=0.25, seed=3)
    return model, prompt, ar, heads


def clp_says_two(heads):
    heads.clp.weight = mx.zeros_like(heads.clp.weight)
    heads.clp.bias = mx.array([0.0, 0.0, 3.0, 0.0])  # CLP: "2 drafts will pass"


def test_verify_feeding_only_what_clp_expects_is_still_exact():
    k = 3
    model, prompt, ar, heads = partly_right_setup(k)
    fed_all, fed_clp = DecodeStats("verify", k), DecodeStats("verify", k)
    assert run(prompt, model, heads, mode="verify", max_tokens=40, stats=fed_all) == ar
    clp_says_two(heads)
    assert run(prompt, model, heads, mode="verify", max_tokens=40, stats=fed_clp, feed="clp") == ar
    assert fed_clp.accepted[3] == 0 < fed_all.accepted[3]  # never fed a third draft


def test_cost_feed_picks_the_best_rate():
    from clp_mlx.decode.feed import best_feed

    flat = [1.0, 1.0, 1.0, 1.0]  # wide passes free: feed everything that may pass
    assert best_feed([0.1, 0.2, 0.3, 0.4], flat, 3) == 3
    steep = [1.0, 1.3, 1.6, 1.9]
    assert best_feed([0.9, 0.05, 0.03, 0.02], steep, 3) == 0  # drafts rarely pass
    # P(L>=1) = 0.8, P(L>=2) = 0.6, P(L>=3) = 0.1: rates 1, 1.38, 1.5, 1.37
    assert best_feed([0.2, 0.2, 0.5, 0.1], steep, 3) == 2
    assert best_feed([0.2, 0.2, 0.5, 0.1], steep, 1) == 1  # capped by max_tokens


def test_verify_feeding_by_cost_is_still_exact(monkeypatch):
    import clp_mlx.decode.verify as dec

    model, prompt, ar, heads = partly_right_setup(3)
    clp_says_two(heads)
    monkeypatch.setattr(dec, "pass_costs", lambda model, n: [1.0, 1.1, 1.2, 5.0][:n])
    stats = DecodeStats("verify", 3)
    assert run(prompt, model, heads, mode="verify", max_tokens=40, stats=stats, feed="cost") == ar
    assert stats.accepted[3] == 0 < stats.accepted[2]  # a 4-token pass never paid off


def test_pass_costs_are_measured_once_per_setup(model, monkeypatch):
    from clp_mlx.decode import feed

    costs = feed.pass_costs(model, 3, context=8, repeats=1)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert feed.pass_costs(model, 2) == costs[:2]  # remembered, not measured again
    feed.forget_measured()  # a new process: the file in the model cache answers
    monkeypatch.setattr(feed, "one_pass_now", lambda model: costs[0])
    assert feed.pass_costs(model, 3) == costs  # as fast as a pass now: kept
    assert list(json.loads(feed._costs_file().read_text()).values()) == [costs]


def test_pass_costs_measured_under_load_are_measured_again(model, monkeypatch):
    """Stored costs whose 1-token pass is far slower than one now (another
    job held the cores) are replaced by a new measurement."""
    from clp_mlx.decode import feed

    slow = [5.0, 5.1, 5.2]
    feed._write_costs({feed._setup_key(model): slow})
    monkeypatch.setattr(feed, "one_pass_now", lambda model: 1.0)  # 5x faster than stored
    times = lambda model, n, context, repeats: [[0.5 + i, 0.4 + i] for i in range(n)]
    monkeypatch.setattr(feed, "_times", times)
    assert feed.pass_costs(model, 3) == [0.4, 1.4, 2.4]  # the fastest of the repeats
    assert list(json.loads(feed._costs_file().read_text()).values()) == [[0.4, 1.4, 2.4]]
    feed.forget_measured()
    monkeypatch.setattr(feed, "one_pass_now", lambda model: 0.3)  # stored 0.4: within STALE
    assert feed.pass_costs(model, 3) == [0.4, 1.4, 2.4]


def test_pass_costs_of_another_kernel_version_are_not_reused(model, monkeypatch):
    """Times taken with an earlier few-row kernel do not decide the feed of a
    faster one: the kernel's source is part of the setup's key."""
    from clp_mlx.decode import feed
    from clp_mlx.native import NativeStatus

    monkeypatch.setattr(feed, "native_status", lambda: NativeStatus("openblas", True, "on"))
    monkeypatch.setattr(feed, "source_key", lambda: "aaaa")
    old = feed._setup_key(model)
    monkeypatch.setattr(feed, "source_key", lambda: "bbbb")
    assert feed._setup_key(model) != old
    monkeypatch.setattr(feed, "source_key", lambda: "aaaa")
    assert feed._setup_key(model) == old
