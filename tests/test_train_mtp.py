"""Training the MTP layer (python -m clp_mlx.cli.train_mtp) on a tiny model's
self-distilled data: it writes a drafter that verify decodes with, a killed
run resumes to the same weights, and --eval reports per-depth agreement."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs
from mlx import nn
from mlx.utils import tree_flatten
from mtp_helpers import distilled, train_argv

from clp_mlx.api import load_with_drafter
from clp_mlx.cli.train_mtp import main
from clp_mlx.errors import ClpError
from clp_mlx.train import mtp_trainer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return distilled(tmp_path_factory.mktemp("train_mtp"))


def weights(folder):
    return dict(mx.load(str(folder / "drafter" / "heads.safetensors")))


def test_training_writes_a_drafter_that_verify_decodes_with(root):
    assert main(train_argv(root, "one")) == 0
    model, _, bundle = load_with_drafter(root / "tiny", root / "one" / "drafter")
    assert bundle.config.design == "mtp" and bundle.k == 2 and bundle.config.draft_vocab == 64
    prompt = [5, 9, 17, 3, 77, 41]
    plain = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=20, mode="ar")]
    fast = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=20, mode="verify")]
    assert fast == plain
    curve = json.loads((root / "one" / "drafter" / "heads.json").read_text())["extra"]["curve"]
    assert [c["step"] for c in curve] == [2, 4, 6]  # every checkpoint checks held-out rows
    assert all(0 <= a <= 1 for c in curve for a in c["held"] + c["acc"])


def test_the_drafter_ships_with_its_report(root, tmp_path):
    """training.json says how it was made (command, data, curve, held-out
    scores); heads-to-package halves it, and verify still decodes as ar."""
    from clp_mlx.sources.packaging import package_heads

    if not (root / "one" / "drafter").is_dir():
        assert main(train_argv(root, "one")) == 0
    report = json.loads((root / "one" / "drafter" / "training.json").read_text())
    assert report["command"].startswith("python -m clp_mlx.cli.train_mtp --model")
    (data,) = report["data"]
    assert data["folder"] == "data" and data["settings"]["kind"] == "wikitext"
    assert report["train_rows"] == data["training_rows"] > 0 and report["train_positions"] > 0
    assert report["held_out"]["data"]["rows"] == data["held_out_rows"] > 0
    assert set(report["held_out"]["data"]["clp_mode"]) >= {"most_likely", "p>=0.9"}
    assert 0 < report["draft_vocab_coverage"] <= 1 and report["resumed_at_step"] == 0
    assert main(train_argv(root, "one")) == 0  # run again: nothing to train, the report stays
    assert json.loads((root / "one" / "drafter" / "training.json").read_text()) == report
    dest = package_heads(root / "one" / "drafter", "qwen2.5-coder-0.5b-instruct", tmp_path)
    assert {v.dtype for v in mx.load(str(dest / "heads.safetensors")).values() if v.ndim > 1} == {
        mx.float16
    }
    model, _, bundle = load_with_drafter(root / "tiny", dest)
    prompt = [5, 9, 17, 3, 77, 41]
    plain = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=20, mode="ar")]
    fast = [t for t, _ in decode_pairs(prompt, model, bundle, max_tokens=20, mode="verify")]
    assert fast == plain


def test_a_killed_run_resumes_to_the_same_weights(root, monkeypatch):
    assert main(train_argv(root, "whole")) == 0
    step = mtp_trainer.MTPTrainer.train_step

    def dying(self):
        if self.step == 3:  # after the checkpoint at step 2, before the one at 4
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(mtp_trainer.MTPTrainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        main(train_argv(root, "killed"))
    monkeypatch.setattr(mtp_trainer.MTPTrainer, "train_step", step)
    assert main(train_argv(root, "killed")) == 0
    whole, resumed = weights(root / "whole"), weights(root / "killed")
    assert whole.keys() == resumed.keys()
    for name in whole:
        np.testing.assert_array_equal(whole[name], resumed[name], err_msg=name)


def test_eval_reports_acceptance_per_depth(root, capsys):
    assert main(train_argv(root, "one", "--eval")) == 0
    report = json.loads(capsys.readouterr().out)["data"]
    assert set(report["accepted_by_depth"]) == {"t+2", "t+3"}
    accepted = list(report["accepted_by_depth"].values())
    assert all(0 <= a <= 1 for a in accepted)
    assert accepted == sorted(accepted, reverse=True)  # a run reaches t+3 only through t+2
    assert report["positions"] > 0 and report["walked_tokens_per_pass"] >= 1
    assert report["walked_with_copies"] >= 1


def test_bad_data_is_one_error(root, tmp_path):
    with pytest.raises(ClpError, match="manifest"):
        main([*train_argv(root, "x")[:2], "--data", str(tmp_path), "--out", str(tmp_path / "o")])


def test_soft_targets_are_the_backbones_distribution_one_position_on(root):
    """--soft 1: each depth's target is the backbone's distribution (over the
    draft vocabulary) at the position whose greedy token is the hard target,
    here computed by running the backbone over the row's tokens."""
    from clp_mlx.cli.train_mtp import _trainer, setup_arg_parser
    from clp_mlx.train.mtp_data import batch

    args = setup_arg_parser().parse_args(train_argv(root, "soft", "--soft", "1"))
    trainer = _trainer(
        args, mtp_trainer.MTPTrainConfig(depths=2, mlp_size=32, draft_vocab=64, soft=1.0)
    )
    b = batch(trainer.rows, np.arange(3), 2, trainer.id_map)
    rows = trainer.rows.gather(np.arange(3), 2)[1]
    logits = trainer.model(mx.array(np.maximum(rows, 0)))[..., mx.array(trainer.vocab_ids)]
    width, first = b["h"].shape[-1], b["first"]
    length = b["h"].shape[1] - first  # anchors from the first with a target
    want = mx.array(0.0)
    for j, g in enumerate(trainer.outputs(b), 1):
        at = np.array(b[f"at{j}"])
        r, s = np.divmod(at, length)
        teacher = logits[mx.array(r), mx.array(first + s + j)].astype(mx.float32)
        teacher = mx.softmax(teacher, axis=-1)
        own = nn.log_softmax(trainer.logits(g.reshape(-1, width)[b[f"at{j}"]]), axis=-1)
        want = want + 0.8 ** (j - 1) * -(teacher * own).sum() / at.size
    got, _ = trainer._loss(b)
    np.testing.assert_allclose(got.item(), want.item(), rtol=2e-3)


def test_a_batch_lists_every_greedy_target_once_from_its_first_anchor(root):
    """Each index (a row, an anchor from ``first``) of depth ``j`` targets the
    row's token ``j + 1`` on, a greedy one in the draft vocabulary; together
    they are every such target, and no anchor before ``first`` has one."""
    from clp_mlx.train.mtp_data import Rows, batch

    rows = Rows.of([root / "data"])
    idx, depths = np.arange(len(rows)), 3
    vocab = np.arange(0, 128, 3)  # a third of the tiny vocabulary
    id_map = np.full(128, -1)
    id_map[vocab] = np.arange(vocab.size)
    b = batch(rows, idx, depths, id_map)
    _, tokens, starts, ends = rows.gather(idx, depths)
    first, n = b["first"], b["h"].shape[1] - b["first"]
    assert 0 < first < starts.min() and b["h"].shape[1] == ends.max()
    for j in range(1, depths + 1):
        want = {(r, s): id_map[tokens[r, s + j + 1]] for r in range(len(idx))
                for s in range(ends[r]) if starts[r] <= s + j + 1 < ends[r]
                and id_map[tokens[r, s + j + 1]] >= 0}  # fmt: skip
        r, s = np.divmod(np.array(b[f"at{j}"]), n)
        got = dict(zip(zip(r.tolist(), (s + first).tolist()), np.array(b[f"y{j}"]).tolist()))
        assert got == want and min(s0 for _, s0 in want) >= first


def test_eval_without_held_out_rows_is_one_error(root):
    from clp_mlx.cli.distill import main as distill

    argv = ["--model", str(root / "tiny"), "--out", str(root / "all-train"), "--kind", "wikitext",
            "--data", str(root / "wiki.txt"), "--prompts", "4", "--prompt-tokens", "6",
            "--new-tokens", "8", "--batch", "4", "--heldout", "0", "--quiet"]  # fmt: skip
    assert distill(argv) == 0
    flags = train_argv(root, "no-held")
    flags[flags.index("--data") + 1] = str(root / "all-train")
    assert main(flags) == 0  # trains: the held-out check is skipped
    with pytest.raises(ClpError, match="no whole held-out shard"):
        main([*flags, "--eval"])


def test_init_from_starts_at_a_drafters_layer(root):
    """--init-from: the layer starts as the drafter's (its weights, not its
    draft vocabulary); a drafter of another shape, or none, is one error."""
    from clp_mlx.cli.train_mtp import _trainer, setup_arg_parser

    if not (root / "one" / "drafter").is_dir():
        assert main(train_argv(root, "one")) == 0
    drafter = str(root / "one" / "drafter")
    args = setup_arg_parser().parse_args(train_argv(root, "more", "--init-from", drafter))
    cfg = mtp_trainer.MTPTrainConfig(depths=2, mlp_size=32, draft_vocab=64, init_from=drafter)
    trainer = _trainer(args, cfg)
    _, _, bundle = load_with_drafter(root / "tiny", drafter)
    ours = dict(tree_flatten(trainer.layer.parameters()))
    theirs = dict(tree_flatten(bundle.mtp.parameters()))
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        np.testing.assert_allclose(ours[key], value, rtol=1e-3, atol=1e-3)
    with pytest.raises(ClpError, match="another shape"):  # narrower: not
        main([*train_argv(root, "x", "--init-from", drafter), "--mlp-size", "16"])
    args = setup_arg_parser().parse_args([*train_argv(root, "wide", "--init-from", drafter)])
    wide = _trainer(args, mtp_trainer.MTPTrainConfig(depths=2, mlp_size=48, init_from=drafter,
                                                     draft_vocab=64))  # fmt: skip
    down = np.array(wide.layer.block.mlp.down_proj.weight)
    np.testing.assert_allclose(down[:, :32], theirs["block.mlp.down_proj.weight"], atol=1e-3)
    assert down.shape[1] == 48 and (down[:, 32:] == 0).all()  # wider: the same function
    with pytest.raises(ClpError, match="does not exist"):
        main(train_argv(root, "x", "--init-from", str(root / "nowhere")))


def test_an_earlier_drafters_ids_fill_what_the_data_leaves():
    """The draft vocabulary is the data's most frequent greedy tokens; where
    the data holds fewer distinct ones, the init drafter's ids come next
    (not the lowest ids), and a token seen once beats one never seen."""
    from clp_mlx.train.trainer import draft_vocabulary

    greedy = np.array([5, 5, 5, 9, 9, 2])
    assert draft_vocabulary(greedy, 3, 20).tolist() == [2, 5, 9]
    assert draft_vocabulary(greedy, 4, 20).tolist() == [0, 2, 5, 9]
    assert draft_vocabulary(greedy, 5, 20, prefer=[17, 12, 5]).tolist() == [2, 5, 9, 12, 17]
    assert draft_vocabulary(greedy, 2, 20, prefer=[17]).tolist() == [5, 9]


def test_keep_vocab_keeps_the_init_drafters_draft_vocabulary(root):
    """--keep-vocab: the drafter trained from --init-from drafts from the same
    token ids (the data here would choose others); it needs --init-from and
    a --draft-vocab of its size."""
    from clp_mlx.cli.train_mtp import _trainer, setup_arg_parser
    from clp_mlx.model.heads_files import save_heads

    if not (root / "one" / "drafter").is_dir():
        assert main(train_argv(root, "one")) == 0
    _, _, bundle = load_with_drafter(root / "tiny", root / "one" / "drafter")
    theirs = np.arange(1, 128, 2)[:64]  # odd ids: not what the data chooses
    assert not np.array_equal(np.array(bundle.draft_vocab), theirs)
    bundle.set_draft_vocab(theirs)
    drafter = str(save_heads(bundle, root / "odd"))
    args = setup_arg_parser().parse_args(train_argv(root, "kept", "--init-from", drafter))
    for keep in (False, True):
        cfg = mtp_trainer.MTPTrainConfig(
            depths=2, mlp_size=32, draft_vocab=len(theirs), init_from=drafter, keep_vocab=keep
        )
        ids = _trainer(args, cfg).vocab_ids
        assert np.array_equal(ids, theirs) == keep
    with pytest.raises(ClpError, match="give --draft-vocab"):
        main([*train_argv(root, "x", "--init-from", drafter, "--keep-vocab"), "--draft-vocab", "9"])
    with pytest.raises(ClpError, match="--keep-vocab keeps"):
        main([*train_argv(root, "x"), "--keep-vocab"])


def drop_setting(out, key):
    """Make the checkpoint in ``out`` look older: its config without ``key``."""
    from clp_mlx.train.trainer import CHECKPOINT

    path = out / CHECKPOINT
    arrays, metadata = mx.load(str(path), return_metadata=True)
    meta = json.loads(metadata["meta"])
    del meta["config"][key]
    mx.save_safetensors(str(path), arrays, metadata={"meta": json.dumps(meta)})


def test_a_checkpoint_from_before_a_new_setting_still_resumes(root):
    """Settings added later (here init_from) count as their defaults when a
    checkpoint lacks them, so older runs resume and --eval finds them."""
    if not (root / "one" / "drafter").is_dir():
        assert main(train_argv(root, "one")) == 0
    drop_setting(root / "one", "init_from")
    assert main([*train_argv(root, "one"), "--eval"]) == 0


def test_a_checkpoint_without_feed_is_never_resumed(root):
    """A layer from before ``feed`` was recorded read another input: its
    checkpoint counts as another configuration, not as the default."""
    assert main(train_argv(root, "old")) == 0
    drop_setting(root / "old", "feed")
    with pytest.raises(ClpError, match="no checkpoint of these flags"):
        main([*train_argv(root, "old"), "--eval"])
