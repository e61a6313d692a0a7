"""Context drafts with no trained drafter: greedy and sampled verify, chat turns,
and heads found by what the weights are."""

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs, random_heads, tiny_model, write_model_folder
from mlx import nn
from mlx_lm.models.cache import make_prompt_cache
from test_sampling import (  # noqa: F401  (a fixture)
    BROKEN,
    PROMPT,
    TEMP,
    chi2_pvalue,
    conditionals,
    counts_of,
    decode_samples,
    exact_joint,
    small,
)

from clp_mlx.decode import sampling
from clp_mlx.decode.config import CONTEXT_K, DecodeConfig
from clp_mlx.decode.lookup import PRIOR, CopyOdds
from clp_mlx.decode.steps import DecodeStats
from clp_mlx.model.backbone import hidden_states
from clp_mlx.model.heads_files import find_heads, save_heads

# A prompt that repeats: copies from it are right where the output repeats it.
LOOP = [5, 9, 14, 3, 7, 22, 5, 9, 14, 3, 7, 22, 5, 9]
# Sampled: up to 2 copies a step, from the prompt held in the cache and the output.
COPIES = dict(num_draft_tokens=2, context=PROMPT[:-1])


def test_no_heads_means_verify_on_context_drafts(model):
    config = DecodeConfig().resolve(model, None)
    assert (config.mode, config.draft_len, config.context_drafts) == ("verify", CONTEXT_K, True)


@pytest.mark.parametrize("feed", ["all", "cost", "clp"])
@pytest.mark.parametrize("tree", [0, 8])
def test_greedy_verify_without_heads_equals_ar(model, feed, tree):
    ar = [t for t, _ in decode_pairs(LOOP, model, mode="ar", max_tokens=40)]
    stats = DecodeStats("verify", CONTEXT_K)
    got = decode_pairs(LOOP, model, None, mode="verify", max_tokens=40, feed=feed, tree=tree, stats=stats)
    assert [t for t, _ in got] == ar
    assert stats.steps + sum(n * c for n, c in enumerate(stats.accepted)) == 40


def test_copies_are_accepted_where_the_output_repeats():
    # With attention switched off every token's successor depends on that
    # token alone: greedy decoding walks a cycle, and copies of it pass.
    model = tiny_model(3)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    stats = DecodeStats("verify", CONTEXT_K)
    got = list(decode_pairs([1, 2, 3], model, None, max_tokens=48, stats=stats, feed="all"))
    ar = [t for t, _ in decode_pairs([1, 2, 3], model, mode="ar", max_tokens=48)]
    assert [t for t, _ in got] == ar
    assert sum(d for _, d in got) > 24 and stats.steps < 24, stats.accepted


def test_copy_odds_learn_how_far_copies_run():
    odds = CopyOdds(3)
    assert odds.scores(0) == [0.0, -math.inf, -math.inf, -math.inf]  # no match: feed nothing
    first, later = PRIOR[2]
    prior = np.exp(odds.scores(2))  # before any copy is checked: the prior's odds
    assert np.allclose(prior[0], 1 - first) and np.allclose(prior[3], first * later**2)
    assert np.exp(odds.scores(3))[3] > prior[3] > np.exp(odds.scores(1))[3]  # longer: runs on
    for _ in range(20):
        odds.learn(2, fed=3, accepted=0)
        odds.learn(1, fed=3, accepted=3)
    assert np.exp(odds.scores(2))[0] > 0.8 and np.exp(odds.scores(1))[3] > 0.8
    assert np.allclose(np.exp(odds.scores(3)), np.exp(CopyOdds(3).scores(3)))  # others untouched


def test_sampled_verify_with_context_drafts_has_the_backbones_distribution(small):  # noqa: F811
    model, _ = small
    stats = DecodeStats("verify", 2)
    counts = counts_of(decode_samples(model, None, "verify", 2000, stats=stats, **COPIES))
    assert chi2_pvalue(counts, exact_joint(conditionals(model, TEMP))) > 1e-3
    # Meaningful only if copies were both accepted and refused.
    assert stats.accepted[1] + stats.accepted[2] > 300 and stats.steps > 2000 + 300, stats.accepted


def test_sampled_verify_with_copies_then_heads_has_the_backbones_distribution(small):  # noqa: F811
    model, _ = small
    heads = random_heads(model, 2, seed=4, scale=0.3, design="chain")
    heads.use_context(3)
    stats = DecodeStats("verify", 2)
    counts = counts_of(decode_samples(model, heads, "verify", 2000, stats=stats, lookup=True, context=PROMPT[:-1]))
    assert chi2_pvalue(counts, exact_joint(conditionals(model, TEMP))) > 1e-3
    assert stats.accepted[1] + stats.accepted[2] > 300, stats.accepted


@pytest.mark.parametrize("name", ["always accept", "residual from p", "residual from q"])
def test_a_broken_rule_shows_with_context_drafts(small, monkeypatch, name):  # noqa: F811
    model, _ = small
    monkeypatch.setattr(sampling, *BROKEN[name])
    counts = counts_of(decode_samples(model, None, "verify", 800, **COPIES))
    assert chi2_pvalue(counts, exact_joint(conditionals(model, TEMP))) < 1e-6


def test_a_later_turn_copies_from_the_earlier_ones():
    """Chat: the context held in the cache is offered to the drafter."""
    model = tiny_model(3, vocab=512, tied=False)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    # Each token's successor, alone; start where the answer does not repeat itself.
    after = np.array(mx.argmax(model(mx.arange(512)[:, None])[:, -1], axis=-1)).tolist()

    def walk(t, n):
        out = []
        for _ in range(n):
            out.append(t := after[t])
        return out

    start = next(t for t in range(512) if len(set(walk(t, 13))) == 13)
    first = [t for t, _ in decode_pairs([start], model, mode="ar", max_tokens=24)]
    assert first[:13] == walk(start, 13)
    earlier = [start, *first, 2]  # the first turn and its answer, then a new turn's token

    def second_turn(context):
        cache = make_prompt_cache(model)
        hidden_states(model, mx.array(earlier), cache)
        return list(
            decode_pairs([start], model, None, prompt_cache=cache, context=context, max_tokens=12, feed="all")
        )

    told, untold = second_turn(earlier), second_turn(None)
    assert [t for t, _ in told] == [t for t, _ in untold] == first[:12]
    drafted = sum(d for _, d in told), sum(d for _, d in untold)
    assert drafted[0] >= 8 and drafted[1] == 0, drafted


@pytest.fixture
def drafters_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLP_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "drafters"


def test_heads_are_found_by_the_weights_they_were_made_for(tmp_path, drafters_home):
    model = tiny_model(0)
    save_heads(random_heads(model, 2, seed=1), drafters_home / "mine")
    assert find_heads(model) == drafters_home / "mine"
    half = tiny_model(0)
    half.set_dtype(mx.float16)
    assert find_heads(half) == drafters_home / "mine"
    quantized = tiny_model(0)
    nn.quantize(quantized, group_size=32, bits=8)
    assert find_heads(quantized) == drafters_home / "mine"
    assert find_heads(tiny_model(1)) is None  # other weights, same shapes


def test_a_model_without_heads_says_so_once_and_decodes(tmp_path, drafters_home, capsys):
    from clp_mlx.cli import generate

    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    assert generate.main(["--model", str(folder), "-p", "abab", "-m", "6", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert err.count("no matching drafter") == 1 and "python -m clp_mlx.train" in err
    assert generate.main(["--model", str(folder), "--heads", "none", "-p", "ab", "-m", "3"]) == 0
    assert "no matching drafter" not in capsys.readouterr().err
