"""--prompt-targets: the rows' prompt positions train too, each on the
backbone's greedy token there (its argmax one position before, from the
stored states), while the layer reads the prompt's own tokens; held-out
checks stay on the greedy continuations."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mtp_helpers import distilled, train_argv

from clp_mlx.cli.train_mtp import _trainer, main, setup_arg_parser
from clp_mlx.errors import ClpError
from clp_mlx.model import backbone
from clp_mlx.train import mtp_trainer
from clp_mlx.train.mtp_data import Rows, batch


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return distilled(tmp_path_factory.mktemp("prompts"))


def argv(root, out, *extra):
    return train_argv(root, out, *extra, steps=4)


def trainer(root, *extra):
    args = setup_arg_parser().parse_args(argv(root, "t", *extra))
    cfg = mtp_trainer.MTPTrainConfig(depths=2, mlp_size=32, draft_vocab=64, batch=3,
                                     prompt_targets="--prompt-targets" in extra)  # fmt: skip
    return _trainer(args, cfg)


def pairs(b: dict, j: int) -> dict:
    """Depth ``j``'s targets of batch ``b``: (row, target position) -> draft index."""
    width = b["h"].shape[1] - b["first"]
    at, y = np.array(b[f"at{j}"]), np.array(b[f"y{j}"])
    return {(int(a) // width, int(a) % width + b["first"] + j + 1): int(t) for a, t in zip(at, y)}


def test_prompt_greedy_is_what_the_backbone_chooses_after_each_prompt_position(root):
    t = trainer(root, "--prompt-targets")
    for i in range(len(t.rows)):
        part, r = t.rows.where[i]
        p = t.rows.parts[part]
        start = int(p["prompt_len"][r])
        prompt = mx.array(np.asarray(p["tokens"][r, :start]))
        h = t.model.model(prompt[None])[0]  # the backbone run afresh on the prompt's text
        fresh = np.array(mx.argmax(backbone.project(t.model, h), axis=-1))
        got = t.prompt_greedy(i)
        assert got.shape == (start + 1,)
        assert got[1:].tolist() == fresh.tolist()
        assert got[start] == p["tokens"][r, start]  # the row's first generated token


def test_prompt_targets_add_the_prompt_positions_and_keep_the_continuations(root):
    t = trainer(root, "--prompt-targets")
    idx = np.arange(6)
    plain = batch(t.rows, idx, 2, t.id_map)
    both = t.batch(idx)
    _, tokens, starts, ends = t.rows.gather(idx, 2)
    added = 0
    for j in (1, 2):
        old, new = pairs(plain, j), pairs(both, j)
        assert old.items() <= new.items()  # every continuation target, unchanged
        for (b, at), y in new.items():
            if (b, at) in old:
                continue
            assert 2 <= at < starts[b] and j + 1 <= at  # a prompt position an anchor reaches
            assert t.vocab_ids[y] == t.prompt_greedy(int(idx[b]))[at]
            added += 1
        # every prompt position whose greedy token the draft vocabulary holds
        want = sum(int(t.id_map[t.prompt_greedy(int(i))[at]] >= 0)
                   for b, i in enumerate(idx) for at in range(j + 1, starts[b]))  # fmt: skip
        assert len(new) - len(old) == want
    assert added > 0  # the prompts' greedy tokens are in the vocabulary often enough to count
    # the layer still reads the prompt's own text
    assert np.array_equal(np.array(both["tokens"]), np.maximum(tokens[:, : ends.max() + 3], 0))


def test_held_out_checks_stay_on_the_continuations(root):
    t = trainer(root, "--prompt-targets")
    held = Rows.for_model([root / "data"], t.model.args, heldout=True)
    idx = np.arange(len(held))
    for j in (1, 2):
        assert pairs(t.batch(idx, held), j) == pairs(batch(held, idx, 2, t.id_map), j)


def test_prompt_targets_count_in_the_grouped_loss_divisor(root):
    rows = Rows.of([root / "data"])
    ends = np.concatenate([p["row_len"] for p in rows.parts])
    assert rows.positions(prompts=True) == int((ends - 2).sum())
    assert rows.positions(prompts=True) > rows.positions()


def test_prompt_targets_train_resume_and_are_their_own_setting(root):
    assert main(argv(root, "p", "--prompt-targets")) == 0
    report = json.loads((root / "p" / "drafter" / "training.json").read_text())
    assert report["train_positions"] == Rows.of([root / "data"]).positions(prompts=True) > 0
    assert main([*argv(root, "p", "--prompt-targets"), "--eval"]) == 0
    with pytest.raises(ClpError, match="no checkpoint of these flags"):
        main([*argv(root, "p"), "--eval"])  # targets of another kind: another run
