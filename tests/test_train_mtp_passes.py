"""--passes: the rows come in passes, every row once a pass (in groups of one
length with --group-by-length), the order seeded, so a resumed run reads the
same batches; without it each step's rows are drawn at random."""

import numpy as np
import pytest
from mtp_helpers import distilled, train_argv

from clp_mlx.cli.train_mtp import _trainer, main, setup_arg_parser
from clp_mlx.errors import ClpError
from clp_mlx.train import mtp_trainer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return distilled(tmp_path_factory.mktemp("passes"))


def argv(root, out, *extra):
    return train_argv(root, out, "--batch", "4", *extra, steps=4)


def trainer(root, *extra):
    args = setup_arg_parser().parse_args(argv(root, "t", *extra))
    cfg = mtp_trainer.MTPTrainConfig(depths=2, mlp_size=32, draft_vocab=64, batch=4, passes=True,
                                     group_by_length="--group-by-length" in extra)  # fmt: skip
    return _trainer(args, cfg)


def one_pass(t, first: int) -> list[np.ndarray]:
    """The batches of the pass that starts at step ``first``."""
    out, seen = [], 0
    while seen < len(t.rows):
        out.append(t.batch_rows(first + len(out)))
        seen += len(out[-1])
    return out


@pytest.mark.parametrize("grouped", [False, True])
def test_a_pass_reads_every_row_once_and_the_next_in_another_order(root, monkeypatch, grouped):
    monkeypatch.setattr(mtp_trainer, "GROUP_BATCHES", 2)  # groups of about 6 rows
    t = trainer(root, *(["--group-by-length"] if grouped else []))
    n = len(t.rows)
    assert n % 4  # a batch short of 4 rows somewhere, or the test shows less
    first = one_pass(t, 0)
    second = one_pass(t, len(first))
    for batches in (first, second):
        rows = np.concatenate(batches)
        assert sorted(rows.tolist()) == list(range(n))
        assert 0 < min(map(len, batches)) and max(map(len, batches)) <= 4
    assert np.concatenate(first).tolist() != np.concatenate(second).tolist()
    if grouped:
        members = {i: k for k, g in enumerate(t.groups) for i in g.tolist()}
        for b in first + second:
            assert len({members[i] for i in b.tolist()}) == 1
    # a resumed run (a new trainer, any step first) reads the same batches
    again = trainer(root, *(["--group-by-length"] if grouped else []))
    for step in (len(first) + 1, 2, len(first) + 1):
        assert again.batch_rows(step).tolist() == (first + second)[step].tolist()


def test_random_draws_repeat_rows_within_what_a_pass_would_read(root):
    t = trainer(root)
    t.cfg.passes = False
    drawn = np.concatenate([t.batch_rows(s) for s in range(len(one_pass(trainer(root), 0)))])
    assert len(set(drawn.tolist())) < len(drawn)  # what --passes is for


def test_passes_trains_resumes_and_is_its_own_setting(root):
    assert main(argv(root, "p", "--passes")) == 0
    assert main([*argv(root, "p", "--passes"), "--eval"]) == 0
    with pytest.raises(ClpError, match="no checkpoint of these flags"):
        main([*argv(root, "p"), "--eval"])
