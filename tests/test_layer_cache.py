"""The MTP layer's keys travel in the prompt cache: a call that goes on from a
kept cache (a chat's next turn, a server's kept request, the bench's shared
prefill) drafts as one call over the whole sequence does."""

import numpy as np
import pytest
from mtp_helpers import attending_layer

from clp_mlx import api
from clp_mlx.bench import methods
from clp_mlx.bench.methods import Start, run_one
from clp_mlx.cli.conversation import Conversation
from clp_mlx.cli.prompt_caches import PromptCaches
from clp_mlx.decode.config import DecodeConfig
from clp_mlx.decode.layer_cache import LayerCache, held, make_prompt_cache, resume, trim_to
from clp_mlx.decode.loop import decode

A = [5, 9, 17, 3, 77, 41, 5, 9, 17, 60, 2, 8]
B = [11, 12, 5, 9]
CONFIG = DecodeConfig(mode="verify", feed="all", context_drafts=False, tree=0)


@pytest.fixture(scope="module")
def setup():
    return attending_layer()


def run(model, bundle, prompt, cache, context, n):
    """The steps of one call writing ``n`` tokens."""
    config = DecodeConfig(**{**CONFIG.__dict__, "max_tokens": n})
    return list(decode(prompt, model, bundle, config, prompt_cache=cache, context=context))


def tokens(steps):
    return [t for s in steps for t in s.tokens]


def same_layer(a: LayerCache, b: LayerCache) -> None:
    assert a.tokens == b.tokens
    np.testing.assert_allclose(np.array(a.keys), np.array(b.keys), atol=1e-4)
    np.testing.assert_allclose(np.array(a.values), np.array(b.values), atol=1e-4)


@pytest.mark.parametrize("keep, lag", [(None, 0), (3, 0), (None, 4)])
def test_a_second_call_drafts_as_one_call_over_the_whole_sequence(setup, keep, lag):
    """``keep``: the first call's tokens kept (None: all; 3: stopped inside
    a step, the layer's last position fused with a token now dropped);
    ``lag``: positions the layer is behind (a call stopped before it saw them)."""
    model, bundle = setup
    cache = make_prompt_cache(model, bundle)
    first = tokens(run(model, bundle, A, cache, None, 10))[:keep]
    seq = A + first
    trim_to(cache, len(seq))
    cache[-1].trim(lag)
    n = held(cache)  # the last token may be unfed: it goes in with the next prompt
    second = run(model, bundle, seq[n:] + B, cache, seq[:n], 12)
    whole = make_prompt_cache(model, bundle)
    once = run(model, bundle, seq + B, whole, None, 12)
    assert tokens(second) == tokens(once)
    assert [s.accepted for s in second] == [s.accepted for s in once]
    assert cache[-1].tokens == (seq + B + tokens(once))[1 : 1 + cache[-1].offset]
    same_layer(cache[-1], whole[-1])
    assert held(cache) == held(whole)


def test_without_the_context_the_layer_goes_on_with_a_gap(setup):
    """No tokens to re-read: the layer goes on from the backbone's position in
    a copy of its cache (a gap in its keys), and the kept cache stays as it
    is; with them, the backbone re-reads the tokens the layer lags by."""
    model, bundle = setup
    cache = make_prompt_cache(model, bundle)
    run(model, bundle, A, cache, None, 6)
    n = held(cache)
    layer, backbone = cache[-1], cache[:-1]
    layer.trim(layer.offset - (n - 3))
    start, feed, used = resume(layer, backbone, B, [])
    assert (start, feed) == (n, B) and used is not layer and used.tokens == layer.tokens
    assert layer.offset == n - 3 and held(backbone) == n
    run(model, bundle, B, cache, None, 5)  # decodes from the gap; the kept layer stays
    assert layer.offset == n - 3 and held(backbone) > n
    trim_to(cache, n)
    context = list(range(n))
    assert resume(layer, backbone, B, context) == (n - 3, context[n - 3 :] + B, layer)
    assert layer.offset == n - 3 and held(backbone) == n - 3


def test_an_ar_call_leaves_the_layer_and_the_next_call_catches_up(setup):
    model, bundle = setup
    cache = make_prompt_cache(model, bundle)
    config = DecodeConfig(mode="ar", max_tokens=5)
    out = [t for s in decode(A, model, bundle, config, prompt_cache=cache) for t in s.tokens]
    assert cache[-1].offset == 0
    seq = A + out
    trim_to(cache, len(seq))
    n = held(cache)
    second = run(model, bundle, seq[n:] + B, cache, seq[:n], 8)
    whole = make_prompt_cache(model, bundle)
    assert tokens(second) == tokens(run(model, bundle, seq + B, whole, None, 8))
    same_layer(cache[-1], whole[-1])


def test_the_bench_start_holds_the_layers_prompt_keys(setup, monkeypatch):
    """Each method decodes from one prefill, which holds the layer's keys of
    the prompt, as a call over the whole prompt makes them."""
    model, bundle = setup
    start = Start.prefill(model, A, heads=bundle)
    whole = make_prompt_cache(model, bundle)
    list(decode(A, model, bundle, DecodeConfig(max_tokens=1), prompt_cache=whole))
    trim_to(whole, len(A) - 1)
    same_layer(start.layer, whole[-1])
    seen = []

    def watched(*args, prompt_cache, **kw):
        seen.append(prompt_cache[-1])
        return decode(*args, prompt_cache=prompt_cache, **kw)

    monkeypatch.setattr(methods, "decode", watched)
    once = run(model, bundle, A, None, None, 12)
    for _ in range(2):  # rewound after each
        assert run_one(model, bundle, start, "verify-heads", 12).tokens == tokens(once)
        assert start.layer.offset == len(A) - 1 and held(start.cache) == len(A) - 1
    assert seen == [start.layer, start.layer]


def test_chat_and_server_caches_carry_the_layer(setup):
    model, bundle = setup
    conv = Conversation.__new__(Conversation)
    conv.model, conv.heads = model, bundle
    conv.tokens, conv.cache = [], make_prompt_cache(model, bundle)
    assert isinstance(conv.cache[-1], LayerCache) and conv.cached == 0
    caches = PromptCaches(model, 2, bundle)
    cache, n = caches.take(A)
    assert n == 0 and isinstance(cache[-1], LayerCache)
    run(model, bundle, A, cache, None, 6)
    caches.give_back(cache, A)  # kept as the prompt's tokens: the layer trimmed with it
    again, n = caches.take(A + B)
    assert n == len(A) and again[-1].offset <= len(A)
    assert isinstance(api.make_prompt_cache(model, bundle)[-1], LayerCache)
    assert not any(isinstance(c, LayerCache) for c in api.make_prompt_cache(model, None))
