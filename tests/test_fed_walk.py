"""Verify's walk as its feed rule feeds it (clp_mlx.train.fed_walk): the
choices are decoding's own, runners-up and all, so the walk commits what
decoding commits."""

import numpy as np
import pytest
from test_rows_eval import root, trained  # noqa: F401  (fixtures: a tiny model, its layer)

from clp_mlx.api import load_with_drafter
from clp_mlx.train import rows_eval
from clp_mlx.train.fed_walk import fed_steps, run_chances
from clp_mlx.train.mtp_data import Rows


def test_a_runner_up_that_was_the_backbones_token_commits_one_more():
    """Flat costs: the two likeliest nodes go in, the first draft and the
    first depth's runner-up (0.35) over the second draft (0.6 * 0.5); the
    draft is wrong, the runner-up right: two tokens. At the row's last
    token nothing is drafted."""
    drafts, target = np.array([[7, 8], [0, 0], [0, 0]]), np.array([[9, 8], [0, 0], [0, 0]])
    alt_ids = np.array([[[7, 9], [8, 4]]] * 3)  # each depth's draft, then its runner-up
    alt_chances = np.array([[[0.6, 0.35], [0.5, 0.3]]] * 3)
    run = np.array([0, 2, 2])
    got = fed_steps(run, drafts, target, alt_ids, alt_chances, [1.0, 1.0, 1.0], 2)
    assert got == [(2, 2), (1, 0)]
    target[0, 0] = 5  # neither right: one token, the same two fed
    got = fed_steps(run, drafts, target, alt_ids, alt_chances, [1.0, 1.0, 1.0], 2)
    assert got[0] == (1, 2)


def test_dear_passes_feed_nothing_unlikely():
    """A pass of two tokens at twice the price: a draft at 0.6 does not pay."""
    drafts = target = np.array([[7, 8], [0, 0]])
    alt_ids = np.array([[[7, 0], [8, 0]]] * 2)  # no runner-up the layer gives a chance
    alt_chances = np.array([[[0.6, 0.0], [0.5, 0.0]]] * 2)
    got = fed_steps(np.array([2, 2]), drafts, target, alt_ids, alt_chances, [1.0, 2.0, 3.0], 2)
    assert got == [(1, 0), (1, 0)]


def test_run_chances_are_the_runs_of_right_drafts():
    assert run_chances([0.5, 0.5]) == pytest.approx([0.5, 0.25, 0.25])
    assert sum(run_chances([1.0, 0.0])) == pytest.approx(1.0)


def test_the_fed_walk_is_what_default_verify_commits(root, trained, monkeypatch):  # noqa: F811
    """Verify with its feed rule (no context copies), at given pass costs,
    commits on each held-out prompt what the fed walk does, pass for pass
    (decoding's first pass, the prefill's token alone, is the walk's last);
    at these costs the depth rule stops the drafting at some passes and not
    at others, and runners-up go in as leaves, so all of it is compared."""
    from clp_mlx.decode import feed, verify
    from clp_mlx.decode.config import DecodeConfig
    from clp_mlx.decode.loop import decode
    from clp_mlx.train import fed_walk

    costs = []
    monkeypatch.setattr(verify, "pass_costs", lambda *a, **k: costs)
    monkeypatch.setattr(feed, "pass_costs", lambda *a, **k: costs)
    walks, stops, trees = [], [], []
    monkeypatch.setattr(rows_eval, "fed_steps", lambda *a: walks.append(fed_steps(*a)) or walks[-1])
    rule, tree = fed_walk.deeper_cannot_pay, fed_walk.best_tree
    monkeypatch.setattr(fed_walk, "deeper_cannot_pay", lambda *a: stops.append(rule(*a)) or stops[-1])
    monkeypatch.setattr(fed_walk, "best_tree", lambda *a: trees.append(tree(*a)) or trees[-1])
    model, _, bundle = load_with_drafter(root / "tiny", trained)
    rows = Rows.of([root / "data"], heldout=True)
    # Dear wide passes and a less sure layer: the depth rule stops some drafting;
    # cheap ones and a second depth made unsure: runners-up of the first go in.
    for costs[:], temperatures in (([1.0, 1.1, 1.5], [1.6, 1.6]), ([1.0, 1.02, 1.04], [1.0, 8.0])):
        bundle.config.temperatures, walks[:] = temperatures, []
        rows_eval.evaluate_rows(model, bundle, rows, costs=list(costs), batch_rows=1)
        for i in range(len(rows)):
            _, row, start, end = rows.gather(np.array([i]), bundle.k)
            n = int(end[0] - start[0])
            config = DecodeConfig(mode="verify", context_drafts=False, max_tokens=n)
            steps = list(decode(row[0, : start[0]].tolist(), model, bundle, config))
            assert [t for s in steps for t in s.tokens][:n] == row[0, start[0] : end[0]].tolist()
            assert walks[i] == [(len(s.tokens), s.fed) for s in steps[1:] + steps[:1]], i
    assert True in stops and False in stops  # the depth rule both ways
    assert any(leaves for _, leaves in trees)  # runners-up fed


def test_train_eval_walks_an_mtp_layer_as_verify_feeds_it(root, trained, capsys):  # noqa: F811
    """`train --eval` of an MTP layer also reports the fed walk, at this
    machine's pass costs (heads of other designs have no runners-up: not there)."""
    import json

    from clp_mlx.cli.train import main as train

    argv = ["--eval", "--model", str(root / "tiny"), "--data", str(root / "data")]
    assert train([*argv, "--heads", str(trained)]) == 0
    fed = json.loads(capsys.readouterr().out)["data"]["walked_as_fed"]
    assert 1.0 <= fed["tokens_per_pass"] <= 3.0 and 0 <= fed["fed_per_pass"] <= 6  # CONTEXT_K
    assert train([*argv, "--heads", str(root / "chain")]) == 0
    assert "walked_as_fed" not in json.loads(capsys.readouterr().out)["data"]
