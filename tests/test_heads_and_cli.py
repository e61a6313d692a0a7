"""Head files (save, load, refusal on the wrong backbone) and CLI errors."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import decode_pairs, random_heads, tiny_model, write_model_folder

from clp_mlx.errors import ClpError
from clp_mlx.cli.generate import main
from clp_mlx.model.heads_files import init_heads, load_heads, save_heads

REPO = Path(__file__).resolve().parents[1]


def drafts(model, heads, prompt=(1, 2, 3)):
    return [t for t, _ in decode_pairs(list(prompt), model, heads, mode="fixed", max_tokens=20)]


def test_saved_heads_load_and_draft_the_same(tmp_path, model):
    heads = random_heads(model, 3, seed=4, scale=0.3)
    save_heads(heads, tmp_path / "h")
    again = load_heads(tmp_path / "h", model)
    assert again.k == 3 and "gate" in again and "head0" in again
    assert drafts(model, again) == drafts(model, heads)
    meta = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert meta["hidden_size"] == 64 and meta["num_layers"] == 2 and meta["fingerprint"]


def test_heads_for_another_backbone_are_refused(tmp_path, model):
    save_heads(init_heads(model, 2), tmp_path / "h")
    other = tiny_model(seed=99)  # same shapes, different weights
    with pytest.raises(ClpError, match="another backbone"):
        load_heads(tmp_path / "h", other)
    wider = tiny_model(seed=0, hidden=32)
    with pytest.raises(ClpError, match="hidden_size"):
        load_heads(tmp_path / "h", wider)


def test_same_backbone_in_half_precision_is_accepted(tmp_path, model):
    save_heads(init_heads(model, 2), tmp_path / "h")
    half = tiny_model(seed=0)
    half.set_dtype(mx.float16)
    assert load_heads(tmp_path / "h", half).k == 2


def test_save_refuses_to_overwrite_and_leaves_nothing_half_written(tmp_path, model):
    heads = init_heads(model, 2)
    save_heads(heads, tmp_path / "h")
    with pytest.raises(ClpError, match="exists"):
        save_heads(heads, tmp_path / "h")
    save_heads(heads, tmp_path / "h", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]


def test_not_a_heads_folder(tmp_path, model):
    with pytest.raises(ClpError, match="heads.json"):
        load_heads(tmp_path, model)
    (tmp_path / "heads.json").write_text("{not json")
    with pytest.raises(ClpError, match="not valid JSON"):
        load_heads(tmp_path, model)


def test_a_bad_tree_branches_is_refused(tmp_path, model):
    save_heads(init_heads(model, 2), tmp_path / "h")
    meta_path = tmp_path / "h" / "heads.json"
    meta = json.loads(meta_path.read_text())
    assert meta["tree_branches"] == 5
    meta_path.write_text(json.dumps({**meta, "tree_branches": 0}))
    with pytest.raises(ClpError, match="tree_branches"):
        load_heads(tmp_path / "h", model)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/folder", "-p", "hi"], "/no/such/folder"),
        (["-p", "hi", "-m", "0"], "--max-tokens"),
        (["-p", "hi", "--num-draft-tokens", "0"], "--draft-len"),
        (["-p", "hi", "--clp-threshold", "1.5"], "--clp-threshold"),
        (["-p", "hi", "--temp", "-1"], "greedy"),
        (["-m", "5", "--kv-bits", "4"], "--kv-bits is not supported"),
        (["-p", "hi", "--draft-len", "0"], "--draft-len"),
    ],
)
def test_cli_bad_input_is_one_clear_error(argv, message):
    with pytest.raises(ClpError, match=message):
        main(argv)


def test_cli_exits_non_zero_without_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "clp_mlx.generate", "--model", "/no/such/folder", "-p", "hi"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_cli_generates_with_init_heads_from_a_model_folder(tmp_path, capsys):
    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    for mode in ("ar", "verify"):
        argv = ["--model", str(folder), "--heads", "init", "--mode", mode, "-p", "ab", "-m", "8"]
        assert main([*argv, "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "tokens per step" in out and "Mode: verify, k=3" in out


def test_draft_vocabulary_is_saved_with_the_heads(tmp_path, model):
    heads = init_heads(model, 2)
    heads.set_draft_vocab([1, 5, 9])
    save_heads(heads, tmp_path / "h")
    again = load_heads(tmp_path / "h", model)
    assert again.draft_vocab.tolist() == [1, 5, 9] and again.config.draft_vocab == 3


def test_context_rows_and_clp_input_rule_are_saved_with_the_heads(tmp_path, model):
    heads = init_heads(model, 2)
    heads.use_context(3)
    heads.config.clp_norm = True
    heads.clp_context = mx.arange(12, dtype=mx.float32).reshape(4, 3)
    save_heads(heads, tmp_path / "h")
    again = load_heads(tmp_path / "h", model)
    assert again.config.lookup == 3 and again.config.clp_norm
    assert mx.array_equal(again.clp_context, heads.clp_context).item()
    h = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(2))
    m = mx.array([0, 1, 2, 3, 0])
    assert mx.allclose(again.clp_logits(h, m), heads.clp_logits(h, m)).item()
    # Scaling h does not change a normalised CLP's scores.
    assert mx.allclose(heads.clp_logits(7 * h, m), heads.clp_logits(h, m), atol=1e-4).item()


def test_chained_heads_draft_in_turn(model):
    """Head i of a "chain" bundle sees the draft of head i-1, as in training."""
    from clp_mlx.model.backbone import embed

    heads = random_heads(model, 3, seed=5, scale=0.5, design="chain")
    h = mx.random.normal((4, model.args.hidden_size), key=mx.random.key(1))
    b = mx.array([1, 2, 3, 4])
    drafts, _ = heads.draft(model, h, b)
    before = mx.concatenate([b[:, None], drafts[:, :-1]], axis=1)
    teacher = heads.draft_ids(model, heads.draft_hidden(h, embed(model, before)))
    assert mx.array_equal(drafts, teacher).item()
    # ... and the drafts do depend on the previous draft, not on b alone
    other = mx.concatenate([b[:, None], (drafts[:, :-1] + 1) % model.args.vocab_size], axis=1)
    assert not mx.array_equal(
        heads.draft_hidden(h, embed(model, other)), heads.draft_hidden(h, embed(model, before))
    ).item()


def test_packaging_heads_halves_them_and_keeps_the_report(model, tmp_path):
    from clp_mlx.model.heads_files import load_heads, save_heads
    from clp_mlx.sources import packaging as tool
    heads = random_heads(model, 2, seed=3, scale=0.5, design="chain")
    src = save_heads(heads, tmp_path / "trained")
    with pytest.raises(ClpError, match="training.json"):
        tool.package_heads(src, "qwen2.5-coder-0.5b-instruct", tmp_path / "shipped")
    (src / "training.json").write_text('{"command": "python -m clp_mlx.train --data /a/b/t.txt"}')
    with pytest.raises(ClpError, match="not a named default model"):
        tool.package_heads(src, "my-model", tmp_path / "shipped")
    dest = tool.package_heads(src, "qwen2.5-coder-0.5b-instruct", tmp_path / "shipped")
    assert sorted(p.name for p in dest.iterdir()) == [
        "heads.json",
        "heads.safetensors",
        "training.json",
    ]
    assert all(
        v.dtype == mx.float16
        for v in mx.load(str(dest / "heads.safetensors")).values()
        if v.ndim > 1
    )
    report = json.loads((dest / "training.json").read_text())
    assert report["command"] == "python -m clp_mlx.train --data t.txt"  # no one's folders
    loaded = load_heads(dest, model)  # back in the backbone's dtype
    assert loaded.heads[0].fuse.weight.dtype == model.model.norm.weight.dtype
    assert mx.allclose(loaded.heads[1].fuse.weight, heads.heads[1].fuse.weight, atol=1e-2).item()


def test_packaging_script_runs_the_convert_subcommand(model, tmp_path, monkeypatch, capsys):
    import importlib.util

    from clp_mlx.sources import packaging

    spec = importlib.util.spec_from_file_location(
        "heads_to_package", REPO / "convert" / "heads_to_package.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(packaging, "SHIPPED", tmp_path / "shipped")
    src = save_heads(random_heads(model, 2, seed=3, design="chain"), tmp_path / "trained")
    assert tool.main([str(src), "qwen2.5-coder-0.5b-instruct"]) == 1
    assert capsys.readouterr().err.startswith("error: ") and not (tmp_path / "shipped").exists()
    (src / "training.json").write_text("{}")
    assert tool.main([str(src), "qwen2.5-coder-0.5b-instruct"]) == 0
    printed = json.loads(capsys.readouterr().out)
    dest = tmp_path / "shipped" / "qwen2.5-coder-0.5b-instruct"
    assert printed["shipped"] == str(dest) and printed["k"] == 2 and printed["design"] == "chain"
