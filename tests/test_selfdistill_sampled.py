"""Openings the model samples itself (``distill --kind sampled``) on a tiny model."""

import pytest
from conftest import tiny_model, write_model_folder

from clp_mlx.cli.args import guarded
from clp_mlx.cli.distill import main
from clp_mlx.errors import ClpError
from clp_mlx.model.backbone import load_backbone
from clp_mlx.train import selfdistill_magpie as magpie
from clp_mlx.train import selfdistill_store as store
from clp_mlx.train.selfdistill import Settings

START = "Once upon a time"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampled") / "tiny"
    write_model_folder(folder, tiny_model(2, tied=False))  # tied: too sure to vary
    return folder


def argv(tiny, out, *extra):
    return ["--model", str(tiny), "--out", str(out), "--kind", "sampled", "--prompts", "6",
            "--prompt-tokens", "7", "--new-tokens", "4", "--batch", "1", "--shard-size", "3",
            "--heldout", "0", "--quiet", "--seed", "5", *extra]  # fmt: skip


def test_openings_are_sampled_after_the_start_and_continued_greedily(tiny, tmp_path):
    out = tmp_path / "rows"
    assert main(argv(tiny, out, "--start", START)) == 0
    model, tokenizer = load_backbone(tiny)
    start = tokenizer.encode(START, add_special_tokens=False)
    stops = magpie.stop_ids(tokenizer)
    prompts = set()
    for folder in store.shard_folders(out):
        a = store.load_shard(folder)
        for i, t, n, length in zip(a["index"], a["tokens"], a["prompt_len"], a["row_len"]):
            # the opening is one of the draws of its index's keys, under this kind's salt
            draws = []
            for attempt in range(magpie.ATTEMPTS):  # one at a time, as --batch 1 drew them
                key = magpie.question_key(5, int(i), attempt, "sampled")
                draws.append(start + magpie.sample_questions(model, start, [key], 7, stops)[0])
            assert t[:n].tolist() in draws and len(start) < n <= len(start) + 7
            assert length == n + 4
            prompts.add(tuple(t[:n].tolist()))
    assert len(prompts) == 6  # six rows, each its own opening


def test_a_start_is_needed_and_only_sampled_takes_one(tiny, tmp_path):
    with pytest.raises(ClpError, match="--kind sampled needs --start TEXT"):
        main(argv(tiny, tmp_path / "a"))
    wiki = tmp_path / "wiki.txt"
    wiki.write_text("a b c d e f g h i j\n" * 20)
    with pytest.raises(ClpError, match="--start is for --kind sampled, not wikitext"):
        Settings(kind="wikitext", prompts=2, start=START)
    with pytest.raises(ClpError, match="takes no --data"):
        main(argv(tiny, tmp_path / "b", "--start", START, "--data", str(wiki)))
    assert not (tmp_path / "b").exists() and not (tmp_path / "a").exists()
    # folders of the other kinds record no start, as before the kind existed
    assert "start" not in Settings(kind="wikitext", prompts=2).record()


def test_another_start_is_refused_on_resume(tiny, tmp_path, capsys):
    out = tmp_path / "rows"
    assert main(argv(tiny, out, "--start", START)) == 0
    assert guarded(lambda: main(argv(tiny, out, "--start", "It was"))) == 1
    err = capsys.readouterr().err
    assert "input content" in err
    assert main(argv(tiny, out, "--start", START)) == 0  # the same start resumes
