"""``convert grow-vocab``: a drafter's draft vocabulary keeps its ids and gains
the most frequent tokens of texts and distilled rows; its layer is unchanged."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model, write_model_folder
from test_boundaries_cli import one_error

from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from clp_mlx.cli.convert import main
from clp_mlx.model.heads_files import init_heads, load_heads, save_heads
from clp_mlx.train.vocab_grow import grown, token_shares


def test_grown_keeps_the_old_ids_and_adds_the_highest_summed_shares():
    a = token_shares(np.array([7, 7, 7, 3, 3, 9]), 12)  # 7: 1/2, 3: 1/3, 9: 1/6
    b = token_shares(np.array([9, 9, 1, 1]), 12)  # 9: 1/2, 1: 1/2
    assert np.isclose(a.sum(), 1) and np.isclose(a[7], 0.5)
    past = token_shares(np.array([7, 7, 3, 12, 99, -1]), 12)  # ids the model has no rows for
    assert past.shape == (12,) and np.isclose(past[7], 2 / 3) and np.isclose(past.sum(), 1)
    assert grown([3, 5], 3, [a, b]).tolist() == [3, 5, 9]  # 9: 2/3
    assert grown([3, 5], 4, [a, b]).tolist() == [1, 3, 5, 9]  # 1 and 7 tie at 1/2: lower id first
    assert grown([3, 5], 5, [a, b]).tolist() == [1, 3, 5, 7, 9]
    assert grown([3, 5], 6, [a, b]).tolist() == [0, 1, 3, 5, 7, 9]  # no count: lowest id


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grow")
    model = tiny_model(0)
    folder = write_model_folder(root / "tiny", model)
    bundle = init_heads(model, 3, design="mtp", gate=False, head0=False, seed=1)
    bundle.set_draft_vocab(list(range(0, 128, 2)))  # the even ids
    save_heads(bundle, root / "drafter")
    (root / "text.txt").write_text("".join(ch * (9 - i) for i, ch in enumerate("abcdefgh")))
    return root, model, folder


def test_the_command_grows_the_vocabulary_and_keeps_the_layer(setup, tmp_path):
    root, model, folder = setup
    out = tmp_path / "grown"
    argv = ["grow-vocab", str(root / "drafter"), "--model", str(folder), "-o", str(out)]
    assert main([*argv, "--size", "66", "--text", str(root / "text.txt")]) == 0
    before, after = load_heads(root / "drafter", model), load_heads(out, model)
    ids = after.draft_vocab.tolist()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    by_count = [tok.encode(ch).ids[0] for ch in "abcdefgh"]  # 9, 8, ... 2 of each
    odd = [i for i in by_count if i % 2]  # the ids not yet drafted, most frequent first
    assert len(odd) >= 2 and len(ids) == 66 and set(range(0, 128, 2)) < set(ids)
    assert sorted(i for i in ids if i % 2) == sorted(odd[:2])
    x, y = dict(tree_flatten(before.mtp.parameters())), dict(tree_flatten(after.mtp.parameters()))
    assert x.keys() == y.keys() and all(mx.array_equal(x[k], y[k]) for k in x)


def test_bad_input_is_one_line(setup, tmp_path, capsys):
    root, _, folder = setup
    base = ["grow-vocab", str(root / "drafter"), "--model", str(folder)]
    text = ["--text", str(root / "text.txt")]
    one_error(main, [*base, "-o", str(tmp_path / "o"), "--size", "64", *text], capsys, "--size")
    one_error(main, [*base, "-o", str(tmp_path / "o"), "--size", "999", *text], capsys, "--size")
    one_error(main, [*base, "-o", str(tmp_path / "o"), "--size", "70"], capsys, "--text")
    missing = ["--text", str(tmp_path / "nope.txt")]
    one_error(main, [*base, "-o", str(tmp_path / "o"), "--size", "70", *missing], capsys, "nope")
    one_error(main, [*base, "-o", str(root / "drafter"), "--size", "70", *text], capsys, "itself")
    nodata = ["--data", str(tmp_path / "nodata")]
    one_error(main, [*base, "-o", str(tmp_path / "o"), "--size", "70", *nodata], capsys, "nodata")
    one_error(main, [*base[:1], str(folder), *base[2:], "-o", str(tmp_path / "o"), "--size", "70",
                     *text], capsys, "heads")  # fmt: skip
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("x")
    one_error(main, [*base, "-o", str(tmp_path / "taken"), "--size", "70", *text], capsys, "exists")
    assert not (tmp_path / "o").exists() and (tmp_path / "taken" / "mine.txt").is_file()
    # refused before any loading: a model that is not there does not come first
    nomodel = ["grow-vocab", str(root / "drafter"), "--model", str(tmp_path / "nomodel")]
    one_error(main, [*nomodel, "-o", str(tmp_path / "taken"), "--size", "70", *text], capsys,
              "exists")  # fmt: skip
    one_error(main, [*nomodel, "-o", str(tmp_path / "o"), "--size", "70"], capsys, "--text")
    one_error(main, [*nomodel, "-o", str(tmp_path / "taken"), "--size", "70", *text, "--force"],
              capsys, "refusing to replace")  # fmt: skip
    assert (tmp_path / "taken" / "mine.txt").is_file()


def test_distilled_rows_count_their_greedy_tokens(tmp_path):
    from mtp_helpers import distilled

    from clp_mlx.train.mtp_data import Rows

    root = distilled(tmp_path)
    model = tiny_model(0)
    greedy = Rows.of([root / "data"]).greedy_tokens()
    counts = np.bincount(greedy, minlength=128)
    top = np.argsort(-counts, kind="stable")[:3]
    # left out: the three most frequent and the three lowest others (what no count would add)
    old = [i for i in range(128) if i not in top][3:63]
    assert counts[top].min() > 0 and sorted(top.tolist()) != [0, 1, 2]
    bundle = init_heads(model, 3, design="mtp", gate=False, head0=False, seed=1)
    bundle.set_draft_vocab(old)
    save_heads(bundle, tmp_path / "drafter")
    argv = ["grow-vocab", str(tmp_path / "drafter"), "--model", str(root / "tiny")]
    out = tmp_path / "grown"
    assert main([*argv, "-o", str(out), "--size", "63", "--data", str(root / "data")]) == 0
    assert load_heads(out, model).draft_vocab.tolist() == sorted([*old, *top.tolist()])
