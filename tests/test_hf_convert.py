"""Hugging Face folder -> MLX folder, from tiny random Qwen2 checkpoints made here.

Each source folder holds a config, a byte-level BPE tokenizer and the weights of
a random mlx-lm Qwen2 (whose parameter names are Hugging Face's), written as
safetensors or as torch-free ``pytorch_model*.bin`` zips.
"""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model, write_tokenizer
from mlx.utils import tree_flatten
from mlx_lm import load
from tokenizers import pre_tokenizers

from clp_mlx.errors import ClpError
from clp_mlx.sources.hf import convert_hf
from clp_mlx.sources.torch_zip import save_torch_file

VOCAB = 320  # more embedding rows than tokens, as in Qwen's checkpoints
TOKENS = mx.array([[1, 5, 42, 300, 7]])


def make_hf_folder(
    folder: Path,
    *,
    fmt: str = "safetensors",
    tied: bool = True,
    shards: int = 1,
    seed: int = 0,
    model_type: str = "qwen2",
    bfloat16: bool = False,
):
    """A Hugging Face style Qwen2 folder; returns the source model for reference."""
    model = tiny_model(seed, vocab=VOCAB, tied=tied)
    folder.mkdir(parents=True)
    args = model.args
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": model_type,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_hidden_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": VOCAB,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "eos_token_id": 256,
    }
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 256}))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    names = sorted(weights)
    parts = [names[i::shards] for i in range(shards)]
    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    files = (
        [f"{stem}.{ext}"]
        if shards == 1
        else [f"{stem}-{i + 1:05d}-of-{shards:05d}.{ext}" for i in range(shards)]
    )
    for part, file in zip(parts, files):
        chunk = {k: weights[k] for k in part}
        if fmt == "safetensors":
            mx.save_safetensors(str(folder / file), {k: mx.array(v) for k, v in chunk.items()})
        else:
            save_torch_file(folder / file, chunk, bfloat16=bfloat16)
    if shards > 1:
        index = {"weight_map": {k: file for part, file in zip(parts, files) for k in part}}
        (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return model


def _logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


@pytest.mark.parametrize(
    "fmt,tied,shards",
    [("safetensors", True, 1), ("bin", False, 2), ("bin", True, 1), ("safetensors", False, 2)],
)
def test_float32_conversion_reproduces_the_source_logits(tmp_path, fmt, tied, shards):
    source = make_hf_folder(tmp_path / "hf", fmt=fmt, tied=tied, shards=shards)
    out = convert_hf(tmp_path / "hf", tmp_path / "mlx", dtype="float32")
    model, tokenizer = load(str(out))
    np.testing.assert_array_equal(_logits(model), _logits(source))
    assert tokenizer.encode("hi!") == [
        sorted(pre_tokenizers.ByteLevel.alphabet()).index(c) for c in "hi!"
    ]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert not list(tmp_path.glob(".mlx.*"))  # no temporary folder left behind


def test_bfloat16_bin_checkpoint_keeps_its_exact_values(tmp_path):
    source = make_hf_folder(tmp_path / "hf", fmt="bin", bfloat16=True)
    model, _ = load(str(convert_hf(tmp_path / "hf", tmp_path / "mlx", dtype="bfloat16")))
    got = dict(tree_flatten(model.parameters()))
    for name, value in tree_flatten(source.parameters()):
        assert got[name].dtype == mx.bfloat16
        assert mx.array_equal(got[name], value.astype(mx.bfloat16)).item(), name


def test_float16_and_quantized_outputs_stay_close(tmp_path):
    source = make_hf_folder(tmp_path / "hf", fmt="bin")
    want = _logits(source)
    half = convert_hf(tmp_path / "hf", tmp_path / "f16")
    model, _ = load(str(half))
    assert model.model.norm.weight.dtype == mx.float16
    np.testing.assert_allclose(_logits(model), want, atol=0.05 * np.abs(want).max())

    q4 = convert_hf(tmp_path / "hf", tmp_path / "q4", q_bits=4, q_group_size=32)
    assert json.loads((q4 / "config.json").read_text())["quantization"]["bits"] == 4
    got = _logits(load(str(q4))[0])
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.9


def test_existing_output_needs_force_and_only_ours_is_replaced(tmp_path):
    make_hf_folder(tmp_path / "hf")
    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "stale.txt").write_text("old")
    with pytest.raises(ClpError, match="already exists"):
        convert_hf(tmp_path / "hf", tmp_path / "mlx")
    with pytest.raises(ClpError, match="not a folder clp-mlx wrote"):
        convert_hf(tmp_path / "hf", tmp_path / "mlx", force=True)
    assert (tmp_path / "mlx" / "stale.txt").read_text() == "old"  # a foreign folder stays
    (tmp_path / "mlx" / "stale.txt").unlink()
    convert_hf(tmp_path / "hf", tmp_path / "mlx", force=True)  # empty: nothing to lose
    made = json.loads((tmp_path / "mlx" / "made_from.json").read_text())
    assert made["made_by"] == "clp-mlx" and made["converter"] == "hf" and made["source"] == "hf"
    convert_hf(tmp_path / "hf", tmp_path / "mlx", force=True, dtype="float32")  # ours: replaced
    assert json.loads((tmp_path / "mlx" / "made_from.json").read_text())["dtype"] == "float32"
    with pytest.raises(ClpError, match="input"):
        convert_hf(tmp_path / "hf", tmp_path / "hf", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mlx"]


def test_bad_sources_are_refused_and_leave_nothing_behind(tmp_path):
    make_hf_folder(tmp_path / "llama", model_type="llama")
    with pytest.raises(ClpError, match="only qwen2"):
        convert_hf(tmp_path / "llama", tmp_path / "out")

    make_hf_folder(tmp_path / "hf", fmt="safetensors", shards=2)
    missing = tmp_path / "hf" / "model-00002-of-00002.safetensors"
    data = missing.read_bytes()
    missing.unlink()
    with pytest.raises(ClpError, match="missing"):
        convert_hf(tmp_path / "hf", tmp_path / "out")

    # A shard that lost its tensors from the index's point of view: names don't fit.
    missing.write_bytes(data)
    (tmp_path / "hf" / "model.safetensors.index.json").unlink()
    (tmp_path / "hf" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ClpError, match="weights do not fit the config: missing"):
        convert_hf(tmp_path / "hf", tmp_path / "out")

    for f in (tmp_path / "hf").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ClpError, match="holds no weights"):
        convert_hf(tmp_path / "hf", tmp_path / "out")

    with pytest.raises(ClpError, match="dtype"):
        convert_hf(tmp_path / "hf", tmp_path / "out", dtype="int8")
    with pytest.raises(ClpError, match="bits"):
        convert_hf(tmp_path / "hf", tmp_path / "out", q_bits=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "llama"]


def test_missing_tokenizer_is_refused(tmp_path):
    make_hf_folder(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").unlink()
    with pytest.raises(ClpError, match="no tokenizer"):
        convert_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _cli():
    path = Path(__file__).resolve().parents[1] / "convert" / "hf_to_mlx.py"
    spec = importlib.util.spec_from_file_location("hf_to_mlx", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_cli_converts_and_reports_errors(tmp_path, capsys):
    main = _cli()
    make_hf_folder(tmp_path / "hf", fmt="bin")
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "mlx"), "--dtype", "float32"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "mlx")]) == 1
    assert capsys.readouterr().err.startswith("error: output folder")
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "mlx"), "--force", "-q", "8"]) == 0
