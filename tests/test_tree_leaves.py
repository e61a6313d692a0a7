"""Runners-up as leaves: the drafter's alternatives join a chain where they pay."""

import math
import random

import mlx.core as mx
import pytest
from conftest import decode_pairs, tiny_model
from mtp_helpers import attending_layer
from test_decode import prompt_of

from clp_mlx.decode import loop, verify
from clp_mlx.decode.drafters import PassDrafts
from clp_mlx.decode.feed import best_feed, best_tree
from clp_mlx.decode.mtp_drafter import RUNNERS_UP, MTPDrafter
from clp_mlx.decode.steps import DecodeStats


def _costs(rng, n):
    steps = [rng.choice([0.0, 0.02, 0.1, 0.4]) for _ in range(n - 1)]
    return [1.0] + [1.0 + sum(steps[:i]) for i in range(1, n)]


def _best_chain(probs, costs, m_max):
    """The chain rule written out: the first m with the most expected tokens per pass time."""
    rates = [
        (1 + sum(sum(probs[j:]) for j in range(1, m + 1))) / costs[m]
        for m in range(min(m_max, len(costs) - 1, len(probs) - 1) + 1)
    ]
    return rates.index(max(rates))


def test_without_alternatives_the_tree_is_the_best_chain():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 6)
        raw = [rng.random() for _ in range(k + 1)]
        probs = [x / sum(raw) for x in raw]
        costs, m_max = _costs(rng, rng.randint(1, 8)), rng.randint(0, 7)
        want = _best_chain(probs, costs, m_max)
        assert best_tree(probs, [], costs, m_max) == (want, [])
        assert best_feed(probs, costs, m_max) == want


def test_a_likely_runner_up_is_fed_and_an_unlikely_one_is_not():
    probs = [0.5, 0.3, 0.2]  # P(L >= 1) = 0.5, P(L >= 2) = 0.2
    alternatives = [[(7, 0.4)], [(8, 0.05)]]  # worth 0.4 and 0.5 * 0.05
    # 1 + 0.5 + 0.4 + 0.2 tokens for 4 fed is the best rate; the 0.025 leaf costs more than it brings.
    assert best_tree(probs, alternatives, [1, 1.05, 1.1, 1.15, 1.2], 2) == (2, [(1, 7)])
    assert best_tree(probs, alternatives, [1, 1.6, 2.2, 2.8, 3.4], 2) == (0, [])
    assert best_tree(probs, alternatives, [1.0] * 5, 1) == (1, [(1, 7)])  # depth 2: past m_max


def test_every_fed_leaf_has_its_parent_fed():
    rng = random.Random(1)
    for _ in range(300):
        k = rng.randint(1, 5)
        raw = [rng.random() ** 3 for _ in range(k + 1)]
        probs = [x / sum(raw) for x in raw]
        alternatives = [[(t, rng.random() * 0.5) for t in range(3)] for _ in range(k)]
        costs, m_max = _costs(rng, rng.randint(1, 9)), rng.randint(0, 6)
        m, leaves = best_tree(probs, alternatives, costs, m_max)
        assert m <= min(m_max, k) and 1 + m + len(leaves) <= len(costs)
        assert all(1 <= j <= m + 1 and j <= m_max for j, _ in leaves)


class Oracle:
    """Its draft is always wrong and its runner-up always the backbone's token."""

    k, in_pass = 1, False

    def __init__(self, greedy: list[int]):
        self.greedy, self.known, self.rows = greedy, 0, []

    def at(self, hidden, choices, accepted):
        self.hidden = hidden
        return PassDrafts(None, None, None, fed=hidden)

    def prompt(self, hidden, tokens):
        self.known = 1  # the prefill's token

    def observe(self, committed, got):
        # A drafter with its own cache sees the accepted path's rows only.
        self.rows.append(mx.array_equal(got.fed, self.hidden[mx.array([0, 2])]).item())
        self.known += len(committed)
        return [math.log(0.9), math.log(0.1)]  # a draft seldom accepted

    def can_branch(self):
        return False

    def candidates(self, depth, count):
        return [[(self.greedy[self.known] + 1) % 128][:depth]]

    def alternatives(self):
        return [[(self.greedy[self.known], 0.8)]]


def test_an_accepted_leaf_commits_its_token_and_the_backbones_next(monkeypatch):
    model = tiny_model(3)
    prompt = prompt_of(7, 5)
    greedy = [t for t, _ in decode_pairs(prompt, model, mode="ar", max_tokens=40)]
    oracle = Oracle(greedy + [0])
    monkeypatch.setattr(loop, "make_drafter", lambda *a, **kw: oracle)
    monkeypatch.setattr(verify, "pass_costs", lambda model, n: [1.0] * n)  # not timed
    stats = DecodeStats("verify", 6)
    got = decode_pairs(prompt, model, mode="verify", feed="cost", max_tokens=40, stats=stats)
    assert [t for t, _ in got] == greedy
    # After the prefill's token and the first pass's, each pass fed the root,
    # the wrong draft and the leaf, and committed the leaf and the backbone's next token.
    assert stats.accepted[1] == 19 and stats.tokens == 40
    assert oracle.rows[1:] == [True] * 19  # the first pass fed one token


@pytest.mark.parametrize("feed", ["cost", "all"])
def test_the_mtp_layer_offers_runners_up_and_verify_stays_greedy(monkeypatch, feed):
    model, bundle = attending_layer()
    fed = []
    propose = verify.propose

    def counted(*args):
        tree = propose(*args)
        fed.append(not tree.is_chain())
        return tree

    monkeypatch.setattr(verify, "propose", counted)
    monkeypatch.setattr(verify, "pass_costs", lambda model, n: [1.0 + 0.01 * i for i in range(n)])
    prompt = prompt_of(9, 2)
    plain = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=30, mode="ar")]
    fast = decode_pairs(prompt, model, bundle, max_tokens=30, mode="verify", feed=feed)
    assert [t for t, _ in fast] == plain
    assert any(fed) == (feed == "cost")  # only the cost rule sizes leaves


def test_alternatives_leave_out_the_draft_and_are_likeliest_first():
    model, bundle = attending_layer()
    tokens = mx.random.randint(0, 128, (12,))
    hidden = model.model(tokens[None])[0]
    drafter = MTPDrafter(model, bundle, runners_up=RUNNERS_UP)
    drafter.prompt(hidden[:9], tokens[1:10])
    drafter.observe(tokens[10:11].tolist(), PassDrafts(None, None, None, fed=hidden[9:10]))
    drafts, others = drafter.candidates(3, 1)[0], drafter.alternatives()
    assert len(others) == len(drafts) == 3
    for draft, pairs in zip(drafts, others):
        chances = [p for _, p in pairs]
        assert len(pairs) == RUNNERS_UP and draft not in [t for t, _ in pairs]
        assert chances == sorted(chances, reverse=True) and 0 < sum(chances) < 1
    assert MTPDrafter(model, bundle).alternatives() == []  # none asked for
