"""Context copies first, the MTP layer elsewhere (clp_mlx.decode.copies_first):
the layer sees every pass, copies are drafted where the context matches, and
verify with both writes greedy decoding's tokens."""

from dataclasses import replace

import mlx.core as mx
import pytest
from conftest import decode_pairs, tiny_model

from clp_mlx import api
from clp_mlx.decode.choose import make_drafter
from clp_mlx.decode.config import CONTEXT_K, MAX_CONTEXT_K, DecodeConfig
from clp_mlx.decode.copies_first import CopiesFirst
from clp_mlx.decode.drafters import PassDrafts
from clp_mlx.decode.mtp_drafter import MTPDrafter
from clp_mlx.decode.sampling import Sampling
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import init_heads


class Inner:
    """A drafter that records what it is asked and drafts [7, 7, 7]."""

    k, in_pass = 3, False

    def __init__(self):
        self.seen, self.asked = [], 0

    def observe(self, committed, got, draft=True):
        self.seen += committed
        self.drafted = draft
        return [-1.0, -2.0, -3.0, -4.0] if draft else []

    def candidates(self, depth, count):
        self.asked += 1
        return [[7, 7, 7][:depth]]

    def can_branch(self):
        return False

    def extend(self, tokens):
        self.seen += tokens


def test_copies_where_the_context_matches_the_inner_drafter_elsewhere():
    inner = Inner()
    drafter = CopiesFirst(inner, [1, 2, 3, 4, 5, 1, 2])
    got = PassDrafts(None, None, None)
    scores = drafter.observe([9], got)  # no earlier 9: no match
    assert scores == [-1.0, -2.0, -3.0, -4.0] and drafter.candidates(3, 1) == [[7, 7, 7]]
    assert inner.drafted
    drafter.observe([1, 2], got)  # "1 2" came before, followed by 3 and later by 9
    assert drafter.candidates(3, 1)[0][0] in (3, 9) and inner.asked == 1  # a copy, not asked
    assert not inner.drafted  # it only followed: its drafts would go unused
    drafter.extend([5])
    assert inner.seen == [9, 1, 2, 5]  # every committed token reaches the inner drafter


def test_copies_run_past_the_inner_drafters_depths():
    inner = Inner()
    drafter = CopiesFirst(inner, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2], k=6)
    got = PassDrafts(None, None, None)
    assert len(drafter.observe([3], got)) == 7  # odds for runs of 0..6 copied drafts
    assert drafter.candidates(6, 1) == [[4, 5, 6, 7, 8, 1]]
    drafter.observe([9], got)  # no match: the inner drafter's at most 3, however deep asked
    assert drafter.candidates(6, 1) == [[7, 7, 7]] and drafter.k == 6


def test_beside_a_copy_head_short_matches_are_left_to_the_inner_drafter():
    inner = Inner()
    drafter = CopiesFirst(inner, [1, 2, 3, 4, 1, 2, 3, 8, 2, 3], shortest=3)
    got = PassDrafts(None, None, None)
    drafter.observe([6], got)  # "2 3 6" never came before, "3 6" neither: no match
    drafter.observe([2, 3], got)  # "2 3" came before, "6 2 3" did not: a 2-token match
    assert drafter.candidates(3, 1) == [[7, 7, 7]] and inner.drafted and not drafter.copying
    drafter.observe([6, 2, 3], got)  # "6 2 3" came before: a 3-token match is copied
    assert drafter.copying and not inner.drafted
    assert drafter.candidates(3, 1) == [[6, 2, 3]] and inner.asked == 1


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(0)
    bundle = init_heads(model, 3, design="mtp", gate=False, head0=False, seed=1)
    mx.random.seed(7)
    o = bundle.mtp.block.self_attn.o_proj
    o.weight = mx.random.normal(o.weight.shape) * 0.3
    bundle.use_context(3)
    return model, bundle


def test_verify_with_copies_and_the_layer_stays_greedy(setup):
    model, bundle = setup
    config = api.decode_config(max_tokens=4).resolve(model, bundle)
    assert config.context_drafts and isinstance(
        make_drafter(model, bundle, config, []), CopiesFirst
    )
    prompt = [5, 9, 17, 3, 77, 41, 5, 9, 17, 3, 77, 41, 5, 9]
    plain = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=40, mode="ar")]
    fast = list(decode_pairs(prompt, model, bundle, max_tokens=40, mode="verify"))
    assert [t for t, _ in fast] == plain
    assert any(d for _, d in fast)  # drafts were accepted: the repeats were copied
    # Where a copy is drafted the layer's cache follows, and it drafts nothing.
    calls, real = [], MTPDrafter.observe

    def observe(self, committed, got, draft=True):
        calls.append(draft)
        return real(self, committed, got, draft)

    try:
        MTPDrafter.observe = observe
        again = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=40, mode="verify")]
    finally:
        MTPDrafter.observe = real
    assert again == plain and calls and not any(calls)  # every step copied: the layer only followed
    alone = replace(api.decode_config(max_tokens=4), context_drafts=False).resolve(model, bundle)
    assert isinstance(make_drafter(model, bundle, alone, []), MTPDrafter)
    assert make_drafter(model, bundle, config, []).shortest == 1  # no copy head: every match


def test_copies_draft_further_than_the_layer_only_in_greedy_verify(setup):
    model, bundle = setup
    verify = api.decode_config(max_tokens=4).resolve(model, bundle)
    assert verify.draft_len == CONTEXT_K and make_drafter(model, bundle, verify, []).k == CONTEXT_K
    assert DecodeConfig(draft_len=MAX_CONTEXT_K).resolve(model, bundle).draft_len == MAX_CONTEXT_K
    with pytest.raises(ClpError, match="draft_len"):
        DecodeConfig(draft_len=MAX_CONTEXT_K + 1).resolve(model, bundle)
    sampled = DecodeConfig(sampling=Sampling(temp=0.8)).resolve(model, bundle)
    alone = DecodeConfig(context_drafts=False).resolve(model, bundle)
    clp = DecodeConfig(mode="clp", context_drafts=True).resolve(model, bundle)
    assert sampled.draft_len == alone.draft_len == clp.draft_len == bundle.k == 3
    with pytest.raises(ClpError, match="draft_len"):
        DecodeConfig(draft_len=4, context_drafts=False).resolve(model, bundle)


def test_sampled_verify_with_copies_runs(setup):
    model, bundle = setup
    sampled = decode_pairs(
        [5, 9, 17, 3, 5, 9, 17], model, bundle, max_tokens=30, mode="verify",
        sampling=Sampling(temp=0.8, seed=3),
    )  # fmt: skip
    assert len(list(sampled)) == 30
