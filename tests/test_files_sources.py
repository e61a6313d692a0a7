"""Hostile model sources end in one ClpError and write nothing: shard paths and
links that leave the model folder, configs of the wrong shape or type, GGUF
metadata of the wrong kind, and outputs or caches that cannot be written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from gguf_fixtures import write_tiny_gguf
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_hf_convert import make_hf_folder

from clp_mlx.errors import ClpError
from clp_mlx.sources.converting import empty_qwen2
from clp_mlx.sources.gguf import convert_gguf
from clp_mlx.sources.hf import convert_hf
from clp_mlx.sources.resolve import resolve_model

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sharded")
    make_hf_folder(root / "hf", shards=2)
    (root / "secret.safetensors").write_bytes((root / "hf" / SHARD2).read_bytes())
    return root / "hf"


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _refused(src: Path, match: str) -> None:
    out = src.parent / "out"
    with pytest.raises(ClpError, match=match):
        convert_hf(src, out, dtype="float32")
    assert not out.exists() and not list(src.parent.glob(".out.*"))


def _set_index(src: Path, weight_map) -> None:
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shard", ["../secret.safetensors", "/etc/hostname", "sub/../../secret.safetensors",
                                   "", "a\0b", "~/x.safetensors/../../../etc/hostname"])
def test_shards_named_outside_the_folder_are_refused(sharded, tmp_path, shard):
    src = _copy(sharded, tmp_path / "hf")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    _set_index(src, {k: (shard if v == SHARD2 else v) for k, v in index.items()})
    _refused(src, "inside the model folder|points outside")


@pytest.mark.parametrize("what", [SHARD2, "tokenizer.json", "config.json"])
def test_links_out_of_the_folder_are_refused(sharded, tmp_path, what):
    src = _copy(sharded, tmp_path / "hf")
    shutil.copy(src / what, tmp_path / "outside")
    (src / what).unlink()
    (src / what).symlink_to(tmp_path / "outside")
    _refused(src, "points outside the model folder")


@pytest.mark.parametrize("index", [[1, 2], {"weight_map": [SHARD1]}, {"weight_map": {"a": 5}},
                                   {"weight_map": {"a": None}}, {"nothing": 1}, "[" * 100000, "\xff\xfe"])
def test_broken_indexes_are_refused(sharded, tmp_path, index):
    src = _copy(sharded, tmp_path / "hf")
    text = index if isinstance(index, str) else json.dumps(index)
    (src / "model.safetensors.index.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    _refused(src, "weight index")


def test_a_hugging_face_cache_snapshot_is_read_through_its_blob_links(sharded, tmp_path):
    """Hub snapshots hold links to ../../blobs: those are the model's own files."""
    repo = tmp_path / "models--owner--name"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(sharded.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    out = convert_hf(snap, tmp_path / "out", dtype="float32")
    assert (out / "model.safetensors").is_file() or any(out.glob("model*.safetensors"))


_VALID = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True}
_HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=4), st.lists(st.integers(), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@example(changes={"rope_scaling": False})
@example(changes={"rope_scaling": {"type": "yarn", "factor": "x"}})
@given(changes=st.dictionaries(st.sampled_from(sorted(_VALID) + ["rope_scaling"]), _HOSTILE, max_size=3))
def test_any_config_builds_a_model_or_is_one_clear_error(changes):
    config = {**_VALID, **changes}
    try:
        empty_qwen2(config, "config.json")
    except ClpError as e:
        assert str(e).startswith("config.json") and "\n" not in str(e)


@pytest.mark.parametrize("config", [[1, 2], None, "qwen2", 3, {**_VALID, "num_attention_heads": 0},
                                    {**_VALID, "hidden_size": "64"}, {**_VALID, "num_hidden_layers": 10**9},
                                    {**_VALID, "vocab_size": 2**40}, {**_VALID, "rope_scaling": [1]}])
def test_hostile_configs_end_before_any_weight_is_read(sharded, tmp_path, config):
    src = _copy(sharded, tmp_path / "hf")
    (src / "config.json").write_text(json.dumps(config))
    _refused(src, "config")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["block_count", "embedding_length", "attention.head_count",
                            "attention.head_count_kv", "feed_forward_length", "context_length",
                            "attention.layer_norm_rms_epsilon"]),
       value=st.one_of(st.just(0), st.just(-1), st.just(2**40), st.just("64"), st.just(1.5),
                       st.just([1, 2]), st.just(True)))
def test_gguf_metadata_of_the_wrong_kind_is_one_clear_error(tmp_path_factory, key, value):
    root = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(root / "bad.gguf", hparams={key: value})
    plausible = key.endswith("epsilon") and type(value) in (int, float) and value > 0
    try:
        convert_gguf(root / "bad.gguf", root / "out", progress=False)
        assert plausible, (key, value)  # never a silent int("64") or int(1.5)
    except ClpError as e:
        assert "\n" not in str(e)
    assert not list(root.glob(".out*"))


def test_an_unwritable_output_is_one_clear_error(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ClpError, match=f"cannot write {tmp_path / 'file' / 'out'}"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "file" / "out", progress=False)
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(ClpError, match="cannot write"):
            convert_gguf(tmp_path / "tiny.gguf", tmp_path / "ro" / "out", progress=False)
    assert (tmp_path / "file").read_text() == "x"


def test_an_unwritable_cache_is_one_clear_error(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("CLP_MLX_HOME", str(tmp_path / "file" / "cache"))
    with pytest.raises(ClpError, match="cannot use .*file.*CLP_MLX_HOME"):
        resolve_model(str(tmp_path / "tiny.gguf"), progress=False, offline=True)


def test_a_loop_of_links_is_one_clear_error(sharded, tmp_path):
    src = _copy(sharded, tmp_path / "hf")
    (src / SHARD2).unlink()
    (src / SHARD2).symlink_to(src / SHARD2)
    _refused(src, "cannot be followed|points outside|missing")
