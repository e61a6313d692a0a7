"""GGUF -> MLX folder conversion on tiny GGUF files written by the tests."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf_fixtures import CHAT_TEMPLATE, LAYERS, VOCAB_ROWS, vocab_tokens, write_tiny_gguf

from clp_mlx.sources import gguf as gguf_convert
from clp_mlx.errors import ClpError
from clp_mlx.sources.gguf import convert_gguf

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gguf_to_mlx", REPO / "convert" / "gguf_to_mlx.py")
gguf_to_mlx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_to_mlx)


def load_weights(folder: Path) -> dict[str, np.ndarray]:
    # safetensors written by the converter, not the GGUF, so mx.load is fine here.
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(file)).items()})
    return weights


def leftovers(folder: Path) -> list[str]:
    """``folder`` and its siblings, hidden temporary ones (``.out.partial-*``) included."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.lstrip(".").startswith(folder.name))


@pytest.fixture(scope="module")
def tied_f32(tmp_path_factory):
    """A tied F32 file converted to float32: the weights must come back bit-exact."""
    root = tmp_path_factory.mktemp("tied")
    src = write_tiny_gguf(root / "tiny.gguf", tied=True)
    out = convert_gguf(root / "tiny.gguf", root / "mlx", dtype="float32", progress=False)
    return src, out


@pytest.fixture(scope="module")
def untied_q8(tmp_path_factory):
    root = tmp_path_factory.mktemp("untied")
    src = write_tiny_gguf(root / "tiny.gguf", tied=False, qtype=QType.Q8_0)
    out = convert_gguf(root / "tiny.gguf", root / "mlx", dtype="float32", progress=False)
    return src, out


def test_tied_f32_weights_and_config(tied_f32):
    src, out = tied_f32
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "made_from.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    weights = load_weights(out)
    assert weights.keys() == src.keys() and "lm_head.weight" not in weights
    for name, values in src.items():
        np.testing.assert_array_equal(weights[name], values, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    tokens, _ = vocab_tokens()
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        LAYERS,
        64,
        128,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == VOCAB_ROWS and config["max_position_embeddings"] == 512
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == tokens.index("<|im_end|>")
    assert config["bos_token_id"] == tokens.index("<|endoftext|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]


def test_untied_q8_matches_within_quantization_error(untied_q8):
    src, out = untied_q8
    weights = load_weights(out)
    assert "lm_head.weight" in weights
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    for name, values in src.items():
        np.testing.assert_array_equal(weights[name], values, err_msg=name)  # same decode as gguf's
    fresh = write_tiny_gguf(out.parent / "f32.gguf", tied=False)  # same seed, unquantized
    for name, values in fresh.items():
        assert np.abs(weights[name] - values).max() <= np.abs(values).max() / 100, name


def test_mlx_lm_loads_and_runs(untied_q8):
    from mlx_lm import load

    src, out = untied_q8
    model, tokenizer = load(str(out))
    logits = model(mx.array([tokenizer.encode("hello world")]))
    assert logits.shape == (1, 2, VOCAB_ROWS)
    np.testing.assert_allclose(np.array(model.lm_head.weight), src["lm_head.weight"])
    tokens, _ = vocab_tokens()
    assert tokenizer.eos_token_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q4_0, QType.BF16, QType.F16])
def test_other_gguf_types(tmp_path, qtype):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=qtype)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "mlx", dtype="float32", progress=False)
    weights = load_weights(out)
    for name, values in src.items():
        np.testing.assert_array_equal(weights[name], values, err_msg=name)


def test_float16_default_and_mlx_quantization(tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "fp16", progress=False)
    weights = mx.load(str(out / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.float16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"

    from mlx_lm import load

    out = convert_gguf(
        tmp_path / "tiny.gguf", tmp_path / "q4", q_bits=4, q_group_size=32, progress=False
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, _ = load(str(out))
    q = model.model.layers[0].mlp.gate_proj
    restored = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    ref = src["model.layers.0.mlp.gate_proj.weight"]
    assert np.abs(np.array(restored.astype(mx.float32)) - ref).max() < 0.05


def test_tokenizer_ids_round_trip_and_chat_template(tied_f32):
    from mlx_lm import load
    from transformers import AutoTokenizer

    _, out = tied_f32
    tokens, _ = vocab_tokens()
    ids = {t: i for i, t in enumerate(tokens)}
    hf = AutoTokenizer.from_pretrained(str(out))
    _, wrapped = load(str(out))
    cases = {
        "hello world": ["hello", "Ġworld"],
        "the  world": ["t", "he", "Ġ", "Ġworld"],  # no prefix space: "the" is not " the"
        "<|im_start|>user\nhello<|im_end|>": [
            "<|im_start|>",
            "u",
            "s",
            "e",
            "r",
            "Ċ",
            "hello",
            "<|im_end|>",
        ],
        "x<tool_call>y": ["x", "<tool_call>", "y"],
        "é!": ["Ã", "©", "!"],
    }
    for text, pieces in cases.items():
        expected = [ids[p] for p in pieces]
        assert hf.encode(text) == expected, text
        assert wrapped.encode(text) == expected, text
        assert hf.decode(expected) == text
    assert (
        hf.decode(hf.encode("<|im_start|>hi<|im_end|><tool_call>"), skip_special_tokens=True)
        == "hi<tool_call>"
    )
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert hf.chat_template == CHAT_TEMPLATE
    prompt = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bad_inputs_raise_and_leave_nothing(tmp_path):
    out = tmp_path / "out"

    def fails(path, match, **kwargs):
        with pytest.raises(ClpError, match=match):
            convert_gguf(path, out, progress=False, **kwargs)
        assert leftovers(out) == []

    fails(tmp_path / "missing.gguf", "not found")
    (tmp_path / "text.gguf").write_text("definitely not a gguf file\n" * 10)
    fails(tmp_path / "text.gguf", "not a readable GGUF")
    write_tiny_gguf(tmp_path / "good.gguf")
    data = (tmp_path / "good.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    fails(tmp_path / "cut.gguf", "not a readable GGUF")
    write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    fails(tmp_path / "llama.gguf", "architecture 'llama'")
    write_tiny_gguf(tmp_path / "notok.gguf", tokenizer=False)
    fails(tmp_path / "notok.gguf", "tokenizer.ggml")
    write_tiny_gguf(
        tmp_path / "extra.gguf",
        extra_tensors={"blk.0.attn_qkv.weight": np.zeros((4, 64), np.float32)},
    )
    fails(tmp_path / "extra.gguf", "unknown GGUF tensor 'blk.0.attn_qkv.weight'")
    write_tiny_gguf(
        tmp_path / "int.gguf", extra_tensors={"blk.9.attn_norm.weight": np.zeros(64, np.int32)}
    )
    fails(tmp_path / "int.gguf", "blk.9.attn_norm.weight.*I32")
    fails(tmp_path / "good.gguf", "dtype", dtype="int8")

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ClpError, match="already exists"):
        convert_gguf(tmp_path / "good.gguf", out, progress=False)
    assert leftovers(out) == ["out"] and (out / "keep.txt").exists()
    with pytest.raises(ClpError, match="not a folder clp-mlx wrote"):
        convert_gguf(tmp_path / "good.gguf", out, force=True, progress=False)
    assert leftovers(out) == ["out"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    for _ in range(2):  # an empty folder, then one it wrote itself
        convert_gguf(tmp_path / "good.gguf", out, force=True, progress=False)
        assert leftovers(out) == ["out"] and (out / "config.json").exists()


def test_interrupted_conversion_leaves_no_folder(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "good.gguf")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_save_weights", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "good.gguf", tmp_path / "out", progress=False)
    assert leftovers(tmp_path / "out") == []
    assert (
        gguf_to_mlx.main(
            [str(tmp_path / "good.gguf"), "-o", str(tmp_path / "out"), "--no-progress"]
        )
        == 130
    )
    assert leftovers(tmp_path / "out") == []


def test_cli(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "good.gguf")
    out = tmp_path / "out"
    assert (
        gguf_to_mlx.main(
            [str(tmp_path / "good.gguf"), "-o", str(out), "--dtype", "bfloat16", "--no-progress"]
        )
        == 0
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert gguf_to_mlx.main([str(tmp_path / "good.gguf"), "-o", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: output folder") and err.count("\n") == 1

    # As a script from the repository root, without installing the package.
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00")
    run = subprocess.run(
        [
            sys.executable,
            "convert/gguf_to_mlx.py",
            str(tmp_path / "bad.gguf"),
            "-o",
            str(tmp_path / "x"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (
        run.returncode == 1 and run.stderr.startswith("error: ") and run.stderr.count("\n") == 1
    ), run.stderr
    assert not (tmp_path / "x").exists()
