"""Hostile heads folders: every one gives a ClpError at load, never a crash,
a wrong answer or a read beyond the backbone's tables (see model/heads_checks.py)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import tiny_model, write_model_folder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clp_mlx.errors import ClpError
from clp_mlx.model.heads import HeadsConfig
from clp_mlx.model.heads_checks import FIELDS
from clp_mlx.model.heads_files import init_heads, load_heads, save_heads

REPO = Path(__file__).resolve().parents[1]
HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def good(tmp_path_factory, model):
    """A valid heads folder with every part: gate, head 0, context rows, a draft vocabulary."""
    heads = init_heads(model, 2, design="chain")
    heads.use_context(3)
    heads.set_draft_vocab([1, 5, 9, 127])
    return save_heads(heads, tmp_path_factory.mktemp("heads") / "good")


def variant(good: Path, where: Path, meta=None, weights=None, raw: bytes | None = None) -> Path:
    """A copy of ``good`` with heads.json fields changed, arrays replaced, or raw weight bytes."""
    shutil.copytree(good, where, dirs_exist_ok=True)
    if meta is not None:
        old = json.loads((good / "heads.json").read_text())
        (where / "heads.json").write_text(json.dumps({**old, **meta}))
    if weights is not None:
        arrays = {**mx.load(str(good / "heads.safetensors")), **weights}
        mx.save_safetensors(str(where / "heads.safetensors"), arrays)
    if raw is not None:
        (where / "heads.safetensors").write_bytes(raw)
    return where


def refused(folder, model, match=None):
    with pytest.raises(ClpError, match=match):
        load_heads(folder, model)


def test_the_good_folder_loads(good, model):
    heads = load_heads(good, model)
    assert heads.draft_vocab.tolist() == [1, 5, 9, 127] and heads.draft_vocab.dtype == mx.int32


def test_every_heads_config_field_has_a_check():
    assert set(FIELDS) == set(HeadsConfig.__dataclass_fields__)


BAD_FIELDS = [
    ("k", 0), ("k", -3), ("k", "2"), ("k", 2.0), ("k", True), ("k", 10**9), ("k", None), ("k", 3),
    ("design", "nope"), ("design", 5), ("hidden_size", "64"), ("hidden_size", 0),
    ("vocab_size", -1), ("num_layers", [2]), ("fingerprint", 7), ("probe", "abc"), ("probe", []),
    ("probe", [1, "x"]), ("probe", [float("nan")] * 256), ("probe", [True] * 256),
    ("probe", [0.0] * 256), ("probe", [1.0] * 7), ("gate_hidden", -1), ("gate_hidden", 10**12),
    ("gate_hidden", 5), ("head0", "yes"), ("head0", False), ("draft_vocab", 10**9),
    ("draft_vocab", 3), ("draft_vocab", -2), ("draft_vocab", 0), ("lookup", 10**6), ("lookup", 2),
    ("lookup", 0), ("lookup", 1.5), ("clp_norm", 1), ("tree_branches", 0), ("tree_branches", "5"),
    ("backbone", {}), ("format", "other"), ("version", "1"), ("temperatures", "1"),
    ("temperatures", [0.0]), ("temperatures", [1e9]), ("temperatures", [True]),
    ("temperatures", [1.0] * 50),
]  # fmt: skip


@pytest.mark.parametrize("field, value", BAD_FIELDS)
def test_a_bad_heads_json_field_is_refused(good, model, tmp_path, field, value):
    refused(variant(good, tmp_path / "h", meta={field: value}), model)


@pytest.mark.parametrize(
    "text",
    ["", "{not json", "[1, 2]", "null", '"heads"', "[" * 100_000, '{"format": "clp-mlx-heads"}'],
)
def test_heads_json_that_is_not_our_object_is_refused(good, model, tmp_path, text):
    folder = variant(good, tmp_path / "h")
    (folder / "heads.json").write_text(text)
    refused(folder, model)


def test_heads_json_that_is_not_utf8_is_refused(good, model, tmp_path):
    folder = variant(good, tmp_path / "h")
    (folder / "heads.json").write_bytes(b'{"k": "\xff\xfe"}')
    refused(folder, model, "not valid JSON")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@HYPOTHESIS
@given(field=st.sampled_from(sorted(FIELDS)), value=json_values)
def test_random_values_in_heads_json_load_or_are_refused(good, model, tmp_path, field, value):
    folder = variant(good, tmp_path / "h", meta={field: value})
    try:
        heads = load_heads(folder, model)
    except ClpError:
        return
    assert heads.k == 2  # accepted: a value the good folder could have held


def weights_of(good):
    return mx.load(str(good / "heads.safetensors"))


def test_hostile_weight_arrays_are_refused(good, model, tmp_path):
    w = weights_of(good)
    name = "heads.0.fuse.weight"
    cases = {
        "out of range id": {"draft_vocab": mx.array([1, 5, 9, 128], dtype=mx.int32)},
        "huge id": {"draft_vocab": mx.array([1, 5, 9, 10**9], dtype=mx.int32)},
        "negative id": {"draft_vocab": mx.array([-1, 5, 9, 12], dtype=mx.int32)},
        "int64 id past the vocabulary": {"draft_vocab": mx.array([1, 5, 9, 2**40], dtype=mx.int64)},
        "float ids": {"draft_vocab": mx.array([1.0, 5, 9, 12])},
        "bool ids": {"draft_vocab": mx.array([True, False, True, True])},
        "wrong shape": {name: w[name].T[:, :-1]},
        "1-D": {name: w[name].reshape(-1)},
        "int weights": {name: w[name].astype(mx.int32)},
        "uint8 weights": {name: w[name].astype(mx.uint8)},
        "complex": {name: w[name].astype(mx.complex64)},
        "nan": {name: mx.where(mx.arange(w[name].size).reshape(w[name].shape) == 3, mx.nan, w[name])},
        "inf": {"clp.bias": mx.full(w["clp.bias"].shape, mx.inf)},
        "an extra array": {"heads.0.spare": mx.zeros((2,))},
        "a third head": {"heads.2.fuse.weight": w[name]},
        "scalar context rows": {"clp_context": mx.array(1.0)},
    }
    for why, arrays in cases.items():
        with pytest.raises(ClpError):
            load_heads(variant(good, tmp_path / why.replace(" ", "_"), weights=arrays), model)


def test_missing_arrays_are_refused(good, model, tmp_path):
    w = weights_of(good)
    for name in ("clp.weight", "draft_vocab", "gate.fc1.weight", "head0.linear.weight", "clp_context"):
        folder = variant(good, tmp_path / name)
        mx.save_safetensors(str(folder / "heads.safetensors"), {k: v for k, v in w.items() if k != name})
        refused(folder, model)


@HYPOTHESIS
@given(cut=st.floats(0, 0.999))
def test_truncated_weights_are_refused(good, model, tmp_path, cut):
    data = (good / "heads.safetensors").read_bytes()
    refused(variant(good, tmp_path / "h", raw=data[: int(len(data) * cut)]), model)


@HYPOTHESIS
@given(garbage=st.binary(max_size=300))
def test_garbage_weights_are_refused(good, model, tmp_path, garbage):
    refused(variant(good, tmp_path / "h", raw=garbage), model)


def test_a_lying_safetensors_header_is_refused(good, model, tmp_path):
    data = (good / "heads.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    for change in ({"shape": [10**6, 10**6]}, {"dtype": "Q9"}, {"data_offsets": [0, 10**12]}):
        head = {**header, "clp.bias": {**header["clp.bias"], **change}}
        text = json.dumps(head).encode()
        raw = len(text).to_bytes(8, "little") + text + data[8 + n :]
        refused(variant(good, tmp_path / "h", raw=raw), model)
    refused(variant(good, tmp_path / "h", raw=(2**62).to_bytes(8, "little") + data[8:]), model)


def test_missing_files_and_folders_are_refused(good, model, tmp_path):
    folder = variant(good, tmp_path / "h")
    (folder / "heads.safetensors").unlink()
    refused(folder, model, "missing")
    refused(tmp_path / "nowhere", model, "does not exist")
    refused(good / "heads.json", model, "not a folder")
    folder = variant(good, tmp_path / "h2")
    (folder / "heads.safetensors").unlink()
    (folder / "heads.safetensors").mkdir()
    refused(folder, model)


def test_generate_with_a_hostile_drafter_exits_with_one_line(good, tmp_path):
    """Out-of-range draft ids once killed generate with SIGSEGV: now one line and status 1."""
    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    bad = variant(good, tmp_path / "bad", weights={"draft_vocab": mx.array([1, 5, 9, 10**6], mx.int32)})
    cmd = [sys.executable, "-m", "clp_mlx.generate", "--model", str(folder), "-p", "ab", "-m", "4"]
    out = subprocess.run([*cmd, "--heads", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("error:") == 1 and "Traceback" not in out.stderr
    assert "draft_vocab" in out.stderr
    debug = subprocess.run([*cmd, "--heads", str(bad), "--debug"], capture_output=True, text=True, cwd=REPO)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ClpError" in debug.stderr


def test_force_replaces_only_a_heads_folder(good, model, tmp_path, monkeypatch):
    heads = load_heads(good, model)
    again = save_heads(heads, variant(good, tmp_path / "old"), force=True)  # heads only: replaced
    (again / "training.json").write_text("{}")
    save_heads(heads, again, force=True)
    foreign = tmp_path / "foreign"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ClpError, match="will not replace"):
        save_heads(heads, foreign, force=True)
    assert (foreign / "notes.txt").read_text() == "mine" and (foreign / "sub").is_dir()
    monkeypatch.chdir(foreign)
    with pytest.raises(ClpError, match="will not replace"):
        save_heads(heads, ".", force=True)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt", "sub"]
