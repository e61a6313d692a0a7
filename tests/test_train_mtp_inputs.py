"""Bad input to train_mtp (and a broken data folder under distill): one
ClpError naming the problem, before any training, never a traceback."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mtp_helpers import distilled

from clp_mlx.cli.distill import main as distill
from clp_mlx.cli.train_mtp import main
from clp_mlx.errors import ClpError


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return distilled(tmp_path_factory.mktemp("train_mtp_inputs"))


def argv(root, data, out, *extra):
    return ["--model", str(root / "tiny"), "--data", str(data), "--out", str(out),
            "--steps", "2", "--batch", "2", "--depths", "2", "--mlp-size", "16",
            "--draft-vocab", "32", "--quiet", *extra]  # fmt: skip


def broken(root, tmp_path, change):
    """A copy of the fixture's data, with ``change(folder)`` done to it."""
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    change(data)
    return data


def shard(data):
    return data / "shard-000000"


def rewrite(path, text):
    path.write_text(text)


def narrow(folder):
    rows, length, _ = np.load(folder / "hidden.npy").shape
    np.save(folder / "hidden.npy", np.zeros((rows, length, 8), np.float16))


CASES = {
    "manifest not JSON": (lambda d: rewrite(d / "manifest.json", "{oops"),
                          "not a valid JSON self-distilled"),  # fmt: skip
    "manifest a list": (lambda d: rewrite(d / "manifest.json", "[]"), "not a self-distilled"),
    "sidecar empty": (lambda d: rewrite(d / "shard-000000.json", "{}"), "not a shard sidecar"),
    "sidecar a list": (lambda d: rewrite(d / "shard-000000.json", "[]"), "not a shard sidecar"),
    "shard folder gone": (lambda d: shutil.rmtree(shard(d)), "not a whole shard"),
    "hidden gone": (lambda d: (shard(d) / "hidden.npy").unlink(), "not a whole shard"),
    "index gone": (lambda d: (shard(d) / "index.npy").unlink(), "index.npy missing"),
    "index of other rows": (lambda d: np.save(shard(d) / "index.npy", np.zeros(1, np.int64)),
                            "disagree on rows"),  # fmt: skip
    "hidden 2-D": (lambda d: np.save(shard(d) / "hidden.npy", np.zeros((3, 4), np.float16)),
                   "not a whole shard"),  # fmt: skip
    "a later shard of another width": (lambda d: narrow(d / "shard-000001"), "wide"),
    "tokens truncated": (lambda d: rewrite(shard(d) / "tokens.npy", ""), "cannot be read"),
    "tokens past the vocabulary": (
        lambda d: np.save(shard(d) / "tokens.npy", np.load(shard(d) / "tokens.npy") + 10**6),
        "past this model's vocabulary",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_broken_data_folder_is_one_error(root, tmp_path, name):
    change, message = CASES[name]
    data = broken(root, tmp_path, change)
    with pytest.raises(ClpError, match=message):
        main(argv(root, data, tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused before training


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--seed", "-1"], "--seed"),
        (["--depths", "65"], "at most 64"),
        (["--depths", "16"], "continue for 16 tokens"),  # the fixture's rows: 16 greedy tokens
    ],
)
def test_out_of_range_settings_are_one_error(root, tmp_path, extra, message):
    with pytest.raises(ClpError, match=message):
        main(argv(root, root / "data", tmp_path / "out", *extra))
    assert not (tmp_path / "out").exists()


def test_out_being_a_file_is_one_error(root, tmp_path):
    (tmp_path / "out").write_text("mine")
    with pytest.raises(ClpError, match="is a file"):
        main(argv(root, root / "data", tmp_path / "out"))
    assert (tmp_path / "out").read_text() == "mine"


def test_the_deepest_depth_the_rows_allow_trains(root, tmp_path):
    assert main(argv(root, root / "data", tmp_path / "out", "--depths", "15")) == 0
    assert (tmp_path / "out" / "drafter" / "heads.safetensors").is_file()


def test_a_checkpoint_with_foreign_metadata_is_one_error(root, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mx.save_safetensors(str(out / "state.safetensors"), {"x": mx.zeros(1)}, {"meta": "[1]"})
    with pytest.raises(ClpError, match="not a checkpoint"):
        main(argv(root, root / "data", out, "--eval"))


def test_distill_into_a_folder_with_a_broken_manifest_is_one_error(root, tmp_path):
    data = broken(root, tmp_path, lambda d: rewrite(d / "manifest.json", json.dumps([1])))
    before = sorted(p.name for p in data.iterdir())
    args = ["--model", str(root / "tiny"), "--out", str(data), "--kind", "wikitext",
            "--data", str(root / "wiki.txt"), "--prompts", "24", "--prompt-tokens", "6",
            "--new-tokens", "16", "--batch", "4", "--shard-size", "8", "--quiet"]  # fmt: skip
    with pytest.raises(ClpError, match="not a self-distilled"):
        distill(args)
    assert sorted(p.name for p in data.iterdir()) == before
