"""The MTP layer as a drafter: its cache follows the committed tokens (each
draft is what the layer computes from scratch over the committed sequence),
it saves and loads as a drafter folder, and verify with it writes greedy
decoding's tokens."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs
from mtp_helpers import attending_layer

from clp_mlx import api
from clp_mlx.decode.choose import make_drafter
from clp_mlx.decode.drafters import PassDrafts
from clp_mlx.decode.feed import best_feed, deeper_cannot_pay
from clp_mlx.decode.mtp_drafter import MTPDrafter, run_scores
from clp_mlx.decode.sampling import Sampling
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import load_heads, save_heads


@pytest.fixture(scope="module")
def setup():
    model, bundle = attending_layer()
    tokens = mx.random.randint(0, 128, (40,))
    hidden = model.model(tokens[None])[0]
    return model, bundle, tokens, hidden


def reference(model, bundle, tokens, hidden, p, drafts):
    """The layer's drafts at anchor ``p`` computed at once over positions 0..p."""
    seq = mx.concatenate([tokens[: p + 2], mx.array(drafts)])
    embed = model.model.embed_tokens
    outs = bundle.mtp.unrolled(
        hidden[None, : p + 1], lambda j: embed(seq[None, j : j + p + 1]), 3, model.model.norm
    )
    return [
        int(mx.argmax(model.model.embed_tokens.as_linear(model.model.norm(g[0, p])))) for g in outs
    ]


def test_the_cache_follows_the_committed_tokens(setup):
    model, bundle, tokens, hidden = setup
    drafter = MTPDrafter(model, bundle)
    drafter.prompt(hidden[:9], tokens[1:10])  # prefill: positions 0..8
    start, checked = 9, 0
    for i, accepted in enumerate([0, 2, 1, 3, 0, 0, 2, 1]):  # rows of each pass verify accepted
        end = start + accepted  # the last accepted position
        fed = mx.concatenate([hidden[start : end + 1], mx.ones((2, hidden.shape[1]))])  # + rejected
        committed = tokens[start + 1 : end + 2].tolist()
        draft = i % 3 != 1  # some steps draft from elsewhere (copies): the cache only follows
        scores = drafter.observe(committed, PassDrafts(None, None, None, fed=fed), draft=draft)
        start = end + 1
        if not draft:
            assert scores == [] and drafter.candidates(3, 1) == [[]]
            continue
        got = drafter.candidates(3, 1)[0]
        assert got == reference(model, bundle, tokens, hidden, end, got[:2])
        checked += 1
    assert checked == 5 and drafter.offset == start


def test_the_cache_follows_unchecked_steps(setup):
    """clp / fixed: a step's fed tokens were all committed (the backbone's
    token, then drafts through extend); every fed row enters the cache."""
    model, bundle, tokens, hidden = setup
    drafter = MTPDrafter(model, bundle)
    drafter.prompt(hidden[:9], tokens[1:10])
    start, rows = 9, 1
    for n in [0, 2, 1, 3, 0, 2]:  # drafts each step commits unchecked
        end = start + rows - 1
        committed = [tokens[end + 1].item()]  # the backbone's token
        drafter.observe(committed, PassDrafts(None, None, None, fed=hidden[start : end + 1]))
        got = drafter.candidates(3, 1)[0]
        assert got == reference(model, bundle, tokens, hidden, end, got[:2])
        drafter.extend(tokens[end + 2 : end + 2 + n].tolist())
        start, rows = end + 1, n + 1
    assert drafter.offset == start


def test_an_mtp_drafter_saves_loads_and_verify_stays_greedy(setup, tmp_path):
    model, bundle, _, _ = setup
    folder = save_heads(bundle, tmp_path / "mtp")
    loaded = load_heads(folder, model)
    assert loaded.config.design == "mtp" and loaded.config.layer == bundle.config.layer
    np.testing.assert_array_equal(loaded.mtp.fc.weight, bundle.mtp.fc.weight)
    prompt = [5, 9, 17, 3, 77, 41, 5, 9, 17]
    plain = list(decode_pairs(prompt, model, loaded, max_tokens=30, mode="ar"))
    fast = list(decode_pairs(prompt, model, loaded, max_tokens=30, mode="verify"))
    assert [t for t, _ in fast] == [t for t, _ in plain]
    for mode in ("clp", "fixed"):
        assert len(list(decode_pairs(prompt, model, loaded, max_tokens=30, mode=mode))) == 30
    sampled = decode_pairs(
        prompt, model, loaded, max_tokens=30, mode="verify", sampling=Sampling(temp=0.8, seed=3)
    )
    assert len(list(sampled)) == 30


def test_a_layer_from_before_the_normed_feed_is_refused(setup, tmp_path):
    """Its later depths were trained to read the raw output: decoding it now
    would draft from inputs it never saw, so it is one error, not bad drafts."""
    model, bundle, _, _ = setup
    folder = save_heads(bundle, tmp_path / "mtp")
    assert bundle.config.layer["feed"] == "norm"
    meta = json.loads((folder / "heads.json").read_text())
    del meta["layer"]["feed"]
    (folder / "heads.json").write_text(json.dumps(meta))
    with pytest.raises(ClpError, match="retrain it"):
        load_heads(folder, model)


def test_run_scores_are_log_chances_of_each_run():
    got = np.exp(np.array(run_scores(mx.array([[0.5, 0.5], [1.0, 0.2]]))))
    np.testing.assert_allclose(got, [[0.5, 0.25, 0.25], [1e-12, 0.8, 0.2]], rtol=1e-5)


def test_make_drafter_picks_the_mtp_drafter(setup):
    model, bundle, _, _ = setup
    config = api.decode_config(max_tokens=4).resolve(model, bundle)
    assert isinstance(make_drafter(model, bundle, config, [], 1, start=5), MTPDrafter)


def test_a_stop_rule_cuts_the_depths_and_no_run_reaches_them(setup):
    model, bundle, tokens, hidden = setup
    seen = []

    def after_one(alive):
        seen.append(list(alive))
        return True

    full, cut = MTPDrafter(model, bundle), MTPDrafter(model, bundle, stop=after_one)
    for d in (full, cut):
        d.prompt(hidden[:9], tokens[1:10])
    fed = PassDrafts(None, None, None, fed=hidden[9:10])
    whole, short = full.observe([tokens[10].item()], fed), cut.observe([tokens[10].item()], fed)
    assert len(seen) == 1 and seen[0][0] == 1.0 and 0 < seen[0][1] <= 1
    assert cut.candidates(3, 1) == [full.candidates(3, 1)[0][:1]]
    assert len(short) == len(whole) == 4 and short[0] == pytest.approx(whole[0], abs=1e-5)
    assert max(short[2:]) < -25  # log(1e-12): no run of 2+ drafts
    assert cut.offset == full.offset == 10


def test_deeper_drafts_are_cut_only_where_they_cannot_change_the_feed():
    """Wherever the rule stops at depth d, the feed chosen from the chances
    padded with zeros after d is the one chosen from all of them."""
    rng = np.random.default_rng(0)
    stops = 0
    for _ in range(2000):
        k = int(rng.integers(2, 6))
        p = rng.uniform(0, 1, k) ** rng.uniform(0.2, 3)
        costs = list(1 + np.cumsum(np.r_[0, rng.uniform(0.02, 0.3, k)]))  # 1 token: 1
        for d in range(1, k):
            alive = [1.0, *np.cumprod(p[:d])]
            if deeper_cannot_pay(alive, costs):
                stops += 1
                padded = np.concatenate([p[:d], np.zeros(k - d)])
                want = best_feed(list(np.exp(np.array(run_scores(mx.array(p))))), costs, k)
                got = best_feed(list(np.exp(np.array(run_scores(mx.array(padded))))), costs, k)
                assert got == want <= d
                break
    assert 300 < stops < 1900  # both cases happen
    assert not deeper_cannot_pay([1.0, 0.9], [1.0, 1.1, 1.2])  # a likely draft: go on
    assert deeper_cannot_pay([1.0, 0.05], [1.0, 1.1, 1.2])  # an unlikely one: stop
