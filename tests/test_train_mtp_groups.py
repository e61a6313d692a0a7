"""--group-by-length: a step's rows come from one group of rows of about one
length, so a batch of long and short rows no longer pads the short ones; every
row stays as likely, and each depth's loss is a sum over the batch's targets
divided by their mean number, so a short row's target weighs what a long one's does."""

import numpy as np
import pytest
from mtp_helpers import distilled

from clp_mlx.cli.distill import main as distill
from clp_mlx.cli.train_mtp import _trainer, main, setup_arg_parser
from clp_mlx.errors import ClpError
from clp_mlx.train import mtp_trainer
from clp_mlx.train.mtp_data import Rows, batch


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The tiny model's 16-token rows, and rows of 4 new tokens beside them."""
    root = distilled(tmp_path_factory.mktemp("groups"))
    argv = ["--model", str(root / "tiny"), "--out", str(root / "short"), "--kind", "wikitext",
            "--data", str(root / "wiki.txt"), "--prompts", "24", "--prompt-tokens", "6",
            "--new-tokens", "4", "--batch", "4", "--shard-size", "8", "--heldout", "0.2",
            "--seed", "1", "--quiet"]  # fmt: skip
    assert distill(argv) == 0
    return root


def argv(root, out, *extra):
    return ["--model", str(root / "tiny"), "--data", str(root / "data"), str(root / "short"),
            "--out", str(root / out), "--steps", "4", "--batch", "3", "--depths", "2",
            "--mlp-size", "32", "--draft-vocab", "64", "--warmup", "2",
            "--checkpoint-every", "2", "--quiet", *extra]  # fmt: skip


def trainer(root, *extra):
    args = setup_arg_parser().parse_args(argv(root, "t", *extra))
    cfg = mtp_trainer.MTPTrainConfig(depths=2, mlp_size=32, draft_vocab=64, batch=3,
                                     group_by_length="--group-by-length" in extra)  # fmt: skip
    return _trainer(args, cfg)


def test_groups_hold_every_row_once_in_order_of_length(root):
    rows = Rows.of([root / "data", root / "short"])
    groups = rows.length_groups(8, seed=0)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(rows)))
    ends = np.concatenate([p["row_len"] for p in rows.parts])
    assert len(set(ends.tolist())) > 1  # two lengths of row, or the test shows nothing
    for a, b in zip(groups, groups[1:]):
        assert ends[a].max() <= ends[b].min()
    assert max(map(len, groups)) - min(map(len, groups)) <= 1


def test_grouped_batches_pad_fewer_positions_and_reach_every_row(root, monkeypatch):
    monkeypatch.setattr(mtp_trainer, "GROUP_BATCHES", 2)  # groups of 6 rows: 38 rows, 6 groups
    plain, grouped = trainer(root), trainer(root, "--group-by-length")
    members = {i: k for k, g in enumerate(grouped.groups) for i in g.tolist()}
    padded, seen = {"plain": 0, "grouped": 0}, set()
    for step in range(200):
        for name, t in (("plain", plain), ("grouped", grouped)):
            idx = t.batch_rows(step)
            b = batch(t.rows, idx, 2, t.id_map)
            _, _, starts, ends = t.rows.gather(idx, 2)
            padded[name] += (b["h"].shape[1] - b["first"]) * len(idx) - int((ends - starts).sum())
        assert len({members[i] for i in idx.tolist()}) == 1  # one group a batch
        seen.update(idx.tolist())
    assert seen == set(range(len(grouped.rows)))
    assert padded["grouped"] < padded["plain"] / 2


def test_a_grouped_loss_is_a_sum_over_the_mean_number_of_targets(root):
    t = trainer(root, "--group-by-length")
    t.cfg.depths = 1  # one depth: its cross-entropy summed over the batch, over one divisor
    b = batch(t.rows, t.batch_rows(0), 1, t.id_map)
    summed, _ = t._loss(b)
    targets = 3 * t.rows.positions() / len(t.rows)  # a batch of 3 rows' mean number of targets
    assert t.targets == pytest.approx(targets)
    t.targets = 0.0  # as without groups: divided by the batch's own number of targets
    mean, _ = t._loss(b)
    n = b["at1"].size
    assert n != pytest.approx(targets)  # so the two divisors differ here
    assert summed.item() * targets == pytest.approx(mean.item() * n)


def test_group_by_length_trains_resumes_and_is_its_own_setting(root):
    assert main(argv(root, "g", "--group-by-length")) == 0
    assert main([*argv(root, "g", "--group-by-length"), "--eval"]) == 0
    with pytest.raises(ClpError, match="no checkpoint of these flags"):
        main([*argv(root, "g"), "--eval"])  # batches of another kind: another run
