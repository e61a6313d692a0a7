"""Scoring a drafter on self-distilled rows (clp_mlx.train.rows_eval): the
drafts it scores are the drafter's own, one anchor at a time, and the
bookkeeping (acceptance per depth, tokens per pass, context copies) is exact
on rows whose answers are known."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mtp_helpers import distilled

from clp_mlx.api import load_with_drafter
from clp_mlx.cli.train import main as train
from clp_mlx.errors import ClpError
from clp_mlx.model.backbone import output_rows
from clp_mlx.model.heads_files import init_heads, save_heads
from clp_mlx.train import rows_eval
from clp_mlx.train.mtp_data import Rows


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = distilled(tmp_path_factory.mktemp("rows_eval"))
    model, _, _ = load_with_drafter(root / "tiny", "none")
    bundle = init_heads(model, 2, design="chain", seed=3, gate=False)
    mx.random.seed(3)  # away from the identity start, so drafts depend on every input
    for head in bundle.heads:
        head.update(tree_map(lambda p: 0.3 * mx.random.normal(p.shape), head.parameters()))
    save_heads(bundle, root / "chain")
    return root


class Known:
    """Rows with given tokens (prompt of 4, then the continuation)."""

    def __init__(self, continuations, width=8):
        self.rows = [[1, 2, 3, 4, *c] for c in continuations]
        self.length, self.width = max(map(len, self.rows)), width

    def __len__(self):
        return len(self.rows)

    def gather(self, idx, depths, side=False):
        tokens = np.full((idx.size, self.length + depths + 1), -1)
        for b, i in enumerate(idx):
            tokens[b, : len(self.rows[i])] = self.rows[i]
        ends = np.array([len(self.rows[i]) for i in idx])
        hidden = np.zeros((idx.size, self.length, self.width), dtype=np.float32)
        return hidden, tokens, np.full(idx.size, 4), ends


class Stub:
    k, config = 3, type("C", (), {"design": "stub"})


def sure_of(n, shape, k=3):
    """CLP scores (..., k + 1) certain of a run of ``n``."""
    return np.where(np.arange(k + 1) == n, 0.0, -30.0) * np.ones((*shape, 1))


def oracle(model, bundle, hidden, tokens):
    """The right draft at every depth of every anchor; CLP sure of all three."""
    tokens, length = np.array(tokens), hidden.shape[1]
    drafts = np.stack([tokens[:, j : j + length] for j in range(2, bundle.k + 2)], axis=-1)
    return drafts, sure_of(3, drafts.shape[:2])


def test_drafts_are_the_heads_own_one_anchor_at_a_time(root):
    model, _, bundle = load_with_drafter(root / "tiny", root / "chain")
    rows = Rows.of([root / "data"], heldout=True)
    hidden, tokens, _, _ = rows.gather(np.arange(2), bundle.k)
    got, clp = rows_eval.chain_drafts(
        model, bundle, mx.array(hidden), mx.array(np.maximum(tokens, 0))
    )
    want = bundle.clp_logits(mx.array(hidden.reshape(-1, hidden.shape[-1])))
    np.testing.assert_allclose(clp.reshape(-1, bundle.k + 1), np.array(want), rtol=1e-5, atol=1e-5)
    for r in range(2):
        for s in range(rows.length):
            one, _ = bundle.draft(
                model, mx.array(hidden[r, s][None]), mx.array([max(0, int(tokens[r, s + 1]))])
            )
            assert got[r, s].tolist() == np.array(one)[0].tolist(), (r, s)


def test_right_drafts_walk_k_plus_one_tokens_a_pass(monkeypatch):
    monkeypatch.setattr(rows_eval, "chain_drafts", oracle)
    rows = Known([[10 + i for i in range(n)] for n in (9, 13)])
    report = rows_eval.evaluate_rows(None, Stub, rows)
    assert report["agreement_t+2"] == 1.0
    assert list(report["accepted_by_depth"].values()) == [1.0, 1.0, 1.0]
    passes = math.ceil(9 / 4) + math.ceil(13 / 4)  # a pass commits the token and 3 drafts
    assert report["walked_tokens_per_pass"] == round(22 / passes, 3)
    assert report["positions"] == 8 + 12  # anchors whose t+2 is in the row
    sure = report["clp_mode"]["most_likely"]  # right drafts, all committed
    assert sure == {"tokens_per_pass": 4.0, "wrong_commit_share": 0.0}


def test_wrong_drafts_walk_one_token_and_copies_help(monkeypatch):
    monkeypatch.setattr(
        rows_eval, "chain_drafts",
        lambda m, b, h, t: (np.full((*h.shape[:2], 3), 99), sure_of(1, h.shape[:2])),
    )  # fmt: skip
    rows = Known([[10, 11, 12] * 6])  # after one period the context predicts the rest
    report = rows_eval.evaluate_rows(None, Stub, rows, lookup=2)
    assert report["agreement_t+2"] == 0.0 and report["walked_tokens_per_pass"] == 1.0
    assert list(report["conditional_by_depth"].values()) == [0.0, 0.0, 0.0]
    assert report["walked_with_copies"] > 2.5
    assert report["clp_mode"]["p>=0.9"] == {"tokens_per_pass": 2.0, "wrong_commit_share": 1.0}


def test_beside_a_copy_head_only_the_longest_matches_are_copied(monkeypatch):
    """As decoding (``copy_shortest``): a drafter with a copy head drafts
    after short matches itself, so fewer of the row's repeats are copied."""
    monkeypatch.setattr(
        rows_eval, "chain_drafts",
        lambda m, b, h, t: (np.full((*h.shape[:2], 3), 99), sure_of(1, h.shape[:2])),
    )  # fmt: skip

    class WithCopyHead(Stub):
        mtp = {"pointer": None}

    rows = Known([[10, 11, 12, 13] * 5])
    every = rows_eval.evaluate_rows(None, Stub, rows, lookup=3)["walked_with_copies"]
    longest = rows_eval.evaluate_rows(None, WithCopyHead, rows, lookup=3)["walked_with_copies"]
    assert every > longest > 1.0
    assert rows_eval.evaluate_rows(None, WithCopyHead, rows, lookup=1)["walked_with_copies"] == every


def test_the_early_walk_reads_only_a_rows_first_tokens(monkeypatch):
    """Drafts right only from the 33rd token on: the whole row walks faster,
    its first 32 tokens one token a pass, none of their drafts accepted."""

    def late(model, bundle, hidden, tokens):
        drafts, _ = oracle(model, bundle, hidden, tokens)
        drafts[:, : 4 + rows_eval.EARLY - 1] = 99  # anchors before the 33rd token
        return drafts, sure_of(3, drafts.shape[:2])

    monkeypatch.setattr(rows_eval, "chain_drafts", late)
    report = rows_eval.evaluate_rows(None, Stub, Known([list(range(10, 74))]), lookup=1)
    assert report["walked_tokens_per_pass_first_32"] == 1.0
    assert report["walked_tokens_per_pass"] > 1.5
    assert set(report["accepted_by_depth_first_32"].values()) == {0.0}
    assert report["accepted_by_depth"]["t+4"] > 0.3
    assert report["walked_with_copies_first_32"] == 1.0  # nothing repeats: no copies


def test_second_depth_right_only_after_the_first(monkeypatch):
    def half(model, bundle, hidden, tokens):
        drafts, _ = oracle(model, bundle, hidden, tokens)
        drafts[:, ::2, 0] = 99  # every other anchor's t+2 is wrong
        return drafts, sure_of(2, drafts.shape[:2])

    monkeypatch.setattr(rows_eval, "chain_drafts", half)
    report = rows_eval.evaluate_rows(None, Stub, Known([list(range(10, 40))]))
    accepted = report["accepted_by_depth"]
    assert 0.4 < accepted["t+2"] < 0.6 and accepted["t+3"] == accepted["t+2"]
    assert report["conditional_by_depth"]["t+3"] == 1.0
    half_wrong = report["clp_mode"]["most_likely"]
    assert half_wrong["tokens_per_pass"] == 3.0
    assert half_wrong["wrong_commit_share"] == pytest.approx(1 - accepted["t+2"])


def test_t2_by_the_backbones_chance_and_misses_the_row_held_before(monkeypatch):
    """Drafts right at every other anchor; the backbone sure (0.95) where they
    are right, unsure (0.2) where not: each bin holds only one kind."""

    def half(model, bundle, hidden, tokens):
        drafts, _ = oracle(model, bundle, hidden, tokens)
        drafts[:, ::2, 0] = 99
        return drafts, sure_of(1, drafts.shape[:2])

    def chance(model, hidden, tokens):  # anchors start at the prompt's last position (3)
        return np.where(np.arange(3, 3 + len(tokens)) % 2 == 0, 0.2, 0.95)

    monkeypatch.setattr(rows_eval, "chain_drafts", half)
    monkeypatch.setattr(rows_eval, "backbone_chance", chance)
    rows = Known([[10, 11, 12, 13] * 5])  # the second period on: every token seen before
    report = rows_eval.evaluate_rows(None, Stub, rows, by_confidence=True)
    bins = report["t+2_by_backbone_chance"]
    assert bins["0.9-1.0"]["t+2"] == 1.0 and bins["0.0-0.3"]["t+2"] == 0.0
    assert bins["0.3-0.5"] == {"share": 0.0, "t+2": None, "misses_in_row": None}
    assert bins["0.9-1.0"]["misses_in_row"] is None  # no misses there
    assert bins["0.0-0.3"]["misses_in_row"] == report["t+2_misses_in_row"]  # all of them
    assert bins["0.9-1.0"]["share"] == pytest.approx(10 / 19, abs=1e-4)  # anchors 3, 5, .., 21
    assert report["backbone_chance_mean"] == pytest.approx((10 * 0.95 + 9 * 0.2) / 19, abs=1e-4)
    # the misses at anchors 4, 6, .., 20 want the row's tokens 6, 8, .., 22: 12, 10, 12, ..;
    # only the first (12, after 1 2 3 4 10 11) is new to the row
    assert report["t+2_misses_in_row"] == pytest.approx(8 / 9, abs=1e-4)


def test_the_backbones_chance_is_its_softmax_at_the_token(root):
    model, _, _ = load_with_drafter(root / "tiny", "none")
    rows = Rows.of([root / "data"], heldout=True)
    hidden, tokens, _, _ = rows.gather(np.arange(1), 2)
    h = hidden[0, :5] * 0.02  # a state the tiny model is unsure at, so every chance counts
    logits = h.astype(np.float64) @ np.array(output_rows(model), dtype=np.float64).T
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    ids = want.argmax(-1)  # its own tokens
    ids[::2] = np.argsort(want[::2], axis=-1)[:, -2]  # and a runner-up
    got = rows_eval.backbone_chance(model, h, ids)
    np.testing.assert_allclose(got, want[np.arange(5), ids], rtol=1e-4, atol=1e-7)


def test_train_eval_scores_heads_on_held_out_rows(root, capsys):
    argv = ["--eval", "--model", str(root / "tiny"), "--heads", str(root / "chain")]
    assert train([*argv, "--data", str(root / "data")]) == 0
    report = json.loads(capsys.readouterr().out)["data"]
    assert set(report["accepted_by_depth"]) == {"t+2", "t+3"}
    assert report["positions"] > 0 and report["walked_with_copies"] >= 1
    with pytest.raises(ClpError, match="not both"):
        train([*argv, "--data", str(root / "data"), str(root / "wiki.txt")])
    assert train([*argv, "--by-confidence", "--data", str(root / "data")]) == 0
    report = json.loads(capsys.readouterr().out)["data"]
    bins = report["t+2_by_backbone_chance"].values()
    assert sum(b["share"] for b in bins) == pytest.approx(1.0, abs=1e-3)
    assert 0 < report["backbone_chance_mean"] <= 1
    with pytest.raises(ClpError, match="needs self-distilled"):
        train([*argv, "--by-confidence", "--data", str(root / "wiki.txt")])
    with pytest.raises(ClpError, match="goes with --eval"):
        train(["--by-confidence", "--data", str(root / "data"), "--out", str(root / "x")])


@pytest.fixture(scope="module")
def trained(root):
    """An MTP layer trained on the rows: its drafter folder."""
    from clp_mlx.cli.train_mtp import main as train_mtp

    argv = ["--model", str(root / "tiny"), "--data", str(root / "data"), "--out", str(root / "m"),
            "--steps", "30", "--batch", "4", "--depths", "2", "--mlp-size", "32", "--lr", "3e-3",
            "--draft-vocab", "64", "--warmup", "2", "--quiet"]  # fmt: skip
    assert train_mtp(argv) == 0
    return root / "m" / "drafter"


def test_the_walk_is_what_decoding_commits(root, trained):
    """Verify (every draft fed, no copies) decoding each held-out prompt
    commits as many tokens a pass as the walk."""
    from clp_mlx.decode.config import DecodeConfig
    from clp_mlx.decode.loop import decode

    model, _, bundle = load_with_drafter(root / "tiny", trained)
    rows = Rows.of([root / "data"], heldout=True)
    report = rows_eval.evaluate_rows(model, bundle, rows)
    assert report["accepted_by_depth"]["t+2"] > 0.3  # drafts that are often right
    tokens = passes = 0
    for i in range(len(rows)):
        _, row, start, end = rows.gather(np.array([i]), bundle.k)
        n = int(end[0] - start[0])
        config = DecodeConfig(mode="verify", feed="all", context_drafts=False, max_tokens=n)
        steps = list(decode(row[0, : start[0]].tolist(), model, bundle, config))
        assert [t for s in steps for t in s.tokens][:n] == row[0, start[0] : end[0]].tolist()
        tokens, passes = tokens + n, passes + len(steps)
    assert tokens / passes == pytest.approx(report["walked_tokens_per_pass"], abs=0.01)


def test_unchecked_decoding_drafts_and_decides_as_the_scorer(root, trained):
    """At its first pass on each held-out prompt, `fixed` decoding commits the
    scorer's drafts there, and `clp` as many as the scorer's CLP decision (the
    trained layer, and a perturbed copy that is less sure of itself)."""
    from clp_mlx.decode.config import DecodeConfig
    from clp_mlx.decode.loop import decode
    from clp_mlx.model.heads import accept_count

    def first_pass(prompt, **settings):
        config = DecodeConfig(context_drafts=False, max_tokens=bundle.k + 2, **settings)
        return next(iter(decode(prompt, model, bundle, config))).tokens

    model, _, bundle = load_with_drafter(root / "tiny", trained)
    bundle.config.temperatures = [0.7, 2.5]  # distinct: each depth must read its own
    rows, seen = Rows.of([root / "data"], heldout=True), set()
    for noise in (0.0, 0.3):
        mx.random.seed(5)
        bundle.mtp.update(
            tree_map(lambda p, s=noise: p + s * mx.random.normal(p.shape), bundle.mtp.parameters())
        )
        for i in range(len(rows)):
            hidden, row, start, _ = rows.gather(np.array([i]), bundle.k)
            drafts, clp = rows_eval.chain_drafts(
                model, bundle, mx.array(hidden), mx.array(np.maximum(row, 0))
            )
            prompt, anchor = row[0, : start[0]].tolist(), start[0] - 1
            assert list(first_pass(prompt, mode="fixed")[1:]) == drafts[0, anchor].tolist()
            for threshold in (None, 0.9):
                want = accept_count(mx.array(clp[0, anchor]), threshold).item()
                got = first_pass(prompt, mode="clp", clp_threshold=threshold)
                assert len(got) - 1 == want, (noise, threshold, i)
                seen.add(want)
    assert len(seen) > 1  # decisions that differ: a test that can fail
