"""Training heads and CLP on a tiny model: loss falls, labels, resume."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs, tiny_model, write_model_folder

from clp_mlx.errors import ClpError
from clp_mlx.cli.train import main
from clp_mlx.train.trainer import run_lengths, walked_tokens_per_pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    folder = write_model_folder(root / "tiny", tiny_model(0, vocab=128))
    text = root / "text.txt"
    rng = np.random.default_rng(0)
    words = ["alpha ", "beta ", "gamma ", "delta\n", "the cat sat ", "on the mat "]
    text.write_text("".join(rng.choice(words, 3000)))
    return root, folder, text


def args(root, folder, text, out, steps=40, extra=()):
    return [
        "--model",
        str(folder),
        "--data",
        str(text),
        "--out",
        str(root / out),
        "--k",
        "2",
        "--steps",
        str(steps),
        "--batch",
        "64",
        "--seq-len",
        "64",
        "--max-tokens",
        "4096",
        "--draft-vocab",
        "64",
        "--checkpoint-every",
        "10",
        "--lr",
        "3e-3",
        "--decision-steps",
        "10",
        *extra,
    ]


def test_held_out_rows_are_whole_prompts_never_trained_on():
    from clp_mlx.train.data import split_rows

    train, held = split_rows(50, seed=0)
    assert len(held) == 5 and not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(50))
    assert (split_rows(50, seed=0)[1] == held).all()  # the same split on resume


def test_clp_labels_are_the_longest_correct_prefix():
    correct = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert run_lengths(correct).tolist() == [2, 0, 4, 1]


def test_walked_verify_passes_over_a_long_run_once():
    # A run of 3 at t=0 commits tokens 0..3; the next pass drafts from t=4.
    runs = np.array([[3, 3, 3, 3, 0, 0, 0, 0], [2, 0, 0, 1, 0, 9, 9, 9]])
    # row 0: passes at 0, 4, 5, 6, 7 -> 8 tokens / 5; row 1: at 0, 3, 5 (cut at
    # the row's end: 3 of its 10 tokens) -> 8 / 3.
    # (1 + the per-position mean would say 2.5 for row 0.)
    assert walked_tokens_per_pass(runs) == 16 / 8


def test_training_lowers_the_loss_and_writes_heads(setup):
    root, folder, text = setup
    assert main(args(root, folder, text, "heads", steps=60)) == 0
    report = json.loads((root / "heads" / "training.json").read_text())
    losses = [h["loss"] for h in report["history"]]
    assert losses[-1] < 0.8 * losses[0], losses
    meta = json.loads((root / "heads" / "heads.json").read_text())
    assert meta["k"] == 2 and meta["gate_hidden"] > 0 and meta["head0"]
    assert sum(report["decisions"]["label_histogram"]) > 0
    held = [h["held"] for h in report["history"]]  # agreement on held-out prompts
    assert len(held[0]) == 2 and all(0 <= a <= 1 for h in held for a in h)
    assert report["held_out_positions"] > 0
    assert meta["lookup"] == 3  # CLP was fitted knowing where drafts are copied
    assert len(report["decisions"]["with_context_agree_with_greedy"]) == 2


def test_eval_reports_heads_alone_and_with_context_drafts(setup, capsys):
    root, folder, text = setup
    if not (root / "heads").exists():
        main(args(root, folder, text, "heads", steps=60))
    capsys.readouterr()
    argv = ["--eval", "--heads", str(root / "heads"), "--model", str(folder), "--data", str(text)]
    assert main([*argv, "--max-tokens", "1200", "--work-dir", str(root / "eval-work")]) == 0
    report = json.loads(capsys.readouterr().out)
    confusion = np.array(report["clp_confusion_rows_label_cols_pred"])
    assert confusion.shape == (3, 3) and confusion.sum() == report["positions"] > 0
    ctx = report["with_context_drafts"]
    # This tiny model's greedy text repeats its last token: copies are right.
    assert ctx["context_match_share"] > 0.9 and ctx["draft_top1_vs_greedy"][0] > 0.9
    assert ctx["expected_tokens_per_pass_verify"] >= 1
    walked = report["chain_verify_tokens_per_pass"]
    assert walked["with_context"] > 2.5 and 1 <= walked["heads"] <= 3  # k = 2


def test_eval_walks_whole_rows_up_to_its_bound(setup, capsys, monkeypatch):
    import clp_mlx.train.evaluate as train

    root, folder, text = setup
    if not (root / "heads").exists():
        main(args(root, folder, text, "heads", steps=60))
    walked, real = [], train.drafts_at
    monkeypatch.setattr(train, "WALK_POSITIONS", 1)  # one row's worth at most
    monkeypatch.setattr(
        train, "drafts_at", lambda m, b, d, idx, lk=0: walked.append(idx) or real(m, b, d, idx, lk)
    )
    argv = ["--eval", "--heads", str(root / "heads"), "--model", str(folder), "--data", str(text)]
    assert main([*argv, "--max-tokens", "1200", "--work-dir", str(root / "eval-work")]) == 0
    capsys.readouterr()
    # First the sampled figures' positions, then the walk's: row 0 only.
    sample, walk = walked
    assert (walk == np.arange(walk.size)).all() and 1 < walk.size < sample.size


def test_resume_after_interrupt_equals_uninterrupted_run(setup):
    root, folder, text = setup
    main(args(root, folder, text, "straight", steps=30))
    with pytest.raises(KeyboardInterrupt):
        main(args(root, folder, text, "resumed", steps=30), stop_after=20)
    assert not (root / "resumed").exists()
    main(args(root, folder, text, "resumed", steps=30))
    report = json.loads((root / "resumed" / "training.json").read_text())
    assert report["resumed_at_step"] == 20
    a = mx.load(str(root / "straight" / "heads.safetensors"))
    b = mx.load(str(root / "resumed" / "heads.safetensors"))
    for key in a:
        if key.startswith(("heads.", "head0.")):
            assert mx.array_equal(a[key], b[key]).item(), key


def test_bad_training_input(setup, tmp_path):
    root, folder, text = setup
    with pytest.raises(ClpError, match="does not exist"):
        main(args(root, folder, tmp_path / "missing.txt", "x"))
    with pytest.raises(ClpError, match="exists"):
        main(args(root, folder, text, str(tmp_path)))  # an existing folder, without --force
    with pytest.raises(ClpError, match="--prompt-tokens must be at least 1"):
        main(args(root, folder, text, "y", extra=["--prompt-tokens", "0"]))
    with pytest.raises(ClpError, match="raise --new-tokens"):
        main(
            args(root, folder, text, "z", extra=["--new-tokens", "2", "--work-dir", str(tmp_path)])
        )
    assert not (root / "z").exists()
    with pytest.raises(ClpError, match="no text is left after the training rows"):
        main(args(root, folder, text, "w", extra=["--source", "text", "--max-tokens", "1000000"]))
    assert not (root / "w").exists()


def test_greedy_continuations_are_what_plain_decoding_writes(tmp_path):
    from clp_mlx.train.features import continue_greedily, load_features

    model = tiny_model(1, vocab=128)
    prompts = np.random.default_rng(3).integers(0, 128, (5, 6)).astype(np.int32)
    continue_greedily(model, prompts, tmp_path, new_tokens=9, batch=2, progress=False)
    tokens, hidden, greedy_ids, start = load_features(tmp_path)
    assert tokens.shape == greedy_ids.shape == (5, 15) and hidden.shape[:2] == (5, 15)
    assert start == 5
    for row, prompt in zip(tokens, prompts):
        ar = [t for t, _ in decode_pairs(mx.array(prompt), model, None, max_tokens=9, mode="ar")]
        assert row[:6].tolist() == prompt.tolist() and row[6:].tolist() == ar
    # from the end of the prompt on, the label at t is the text's token t+1
    assert (greedy_ids[:, start:-1] == tokens[:, start + 1 :]).all()
    # an interrupted run (one chunk lost) resumes to the same features
    (tmp_path / "chunk000002.npz").unlink()
    continue_greedily(model, prompts, tmp_path, new_tokens=9, batch=2, progress=False)
    again = load_features(tmp_path)
    assert (again[0] == tokens).all() and (again[1] == hidden).all()


def test_chained_heads_on_the_text_itself(setup):
    root, folder, text = setup
    extra = ["--source", "text", "--design", "chain"]
    assert main(args(root, folder, text, "text-heads", steps=30, extra=extra)) == 0
    report = json.loads((root / "text-heads" / "training.json").read_text())
    assert report["train_tokens"] == 4096  # 64 rows of 64 text tokens, not continuations
    # CLP and the gate learn on greedy continuations of prompts after those rows
    held = json.loads((root / "text-heads.work" / "features-held" / "features.json").read_text())
    assert held["start"] == 31 and held["shape"][1] == 32 + 80
    assert report["held_out_positions"] > 0
    losses = [h["loss"] for h in report["history"]]
    assert losses[-1] < 0.8 * losses[0], losses


def test_heads_see_the_rows_tokens_that_their_labels_follow():
    from clp_mlx.train.trainer import Positions

    rng = np.random.default_rng(5)
    n, length, k = 3, 12, 2
    tokens = rng.integers(0, 50, (n, length)).astype(np.int32)
    greedy_ids = rng.integers(0, 50, (n, length)).astype(np.int32)
    hidden = np.zeros((n, length, 4), np.float16)
    # teacher-forced text: the backbone's guess at t+1 differs from the text,
    # and the label b_{t+1+i} is conditioned on the text's tokens t+1..t+i
    data = Positions(tokens, hidden, greedy_ids, k)
    b = data.batch(np.arange(len(data)))
    at = data.index
    assert (np.array(b["b"]) == tokens.reshape(-1)[at + 1]).all()
    assert (np.array(b["b"]) != greedy_ids.reshape(-1)[at]).any()
    assert (np.array(b["before"]) == tokens.reshape(-1)[at[:, None] + [1, 2]]).all()
    # a greedy continuation: the row's token t+1 is the backbone's choice at t,
    # so the same batch is what the previous heads should have drafted
    tokens[:, 1:] = greedy_ids[:, :-1]
    data = Positions(tokens, hidden, greedy_ids, k)
    b = data.batch(np.arange(len(data)))
    assert (np.array(b["b"]) == greedy_ids.reshape(-1)[data.index]).all()
    before = np.concatenate([np.array(b["b"])[:, None], np.array(b["future_b"])[:, :-1]], 1)
    assert (np.array(b["before"]) == before).all()
