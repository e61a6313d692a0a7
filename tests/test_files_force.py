"""``--force`` replaces only what clp-mlx wrote: never the current or home folder,
a folder holding the input, a link, a file or a folder of someone else's; each
refusal is one line and exit status 1, and nothing on disk changes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import tiny_model
from gguf_fixtures import write_tiny_gguf
from test_hf_convert import make_hf_folder
from test_torch_heads import _mlx_folder, medusa_state

from clp_mlx.cli.convert import main
from clp_mlx.sources.torch_zip import save_torch_file


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its kind and content hash (links not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + str(p.readlink())
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    return out


def refused(capsys, argv: list[str], why: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to replace") and err.count("\n") == 1, err
    assert why in err, err


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A home with a work folder (the cwd) holding a GGUF beside user files."""
    home = tmp_path / "home"
    work = home / "work"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    write_tiny_gguf(work / "tiny.gguf")
    (work / "notes.txt").write_text("mine")
    (work / "models").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "precious.txt").write_text("keep")
    return tmp_path


def _gguf(out: str) -> list[str]:
    return ["gguf", "tiny.gguf", "-o", out, "--force", "--no-progress"]


def test_force_never_replaces_what_it_did_not_write(world, capsys):
    work, before = world / "home" / "work", tree(world)
    (work / "models" / "x.txt").write_text("user")
    (work / "link").symlink_to(world / "elsewhere")
    cases = [
        (".", "the current folder"),
        (str(work), "the current folder"),
        ("..", "the current folder"),
        (str(world / "home"), "the current folder"),
        ("link", "symbolic link"),
        ("notes.txt", "not a folder"),
        ("models", "not a folder clp-mlx wrote"),
        (str(world / "elsewhere"), "not a folder clp-mlx wrote"),
    ]
    before = tree(world)
    for out, why in cases:
        refused(capsys, _gguf(out), why)
    assert tree(world) == before


def test_the_folder_of_the_source_is_never_replaced(world, capsys, monkeypatch):
    src = world / "src"
    src.mkdir()
    write_tiny_gguf(src / "model.gguf")
    monkeypatch.chdir(world / "elsewhere")
    before = tree(world)
    refused(capsys, ["gguf", str(src / "model.gguf"), "-o", str(src), "--force"], "the input")
    refused(capsys, ["gguf", str(src / "model.gguf"), "-o", str(world), "--force"], "current folder")
    assert tree(world) == before


def test_home_is_never_replaced(world, capsys, monkeypatch):
    monkeypatch.chdir(world / "elsewhere")
    before = tree(world)
    src = str(world / "home" / "work" / "tiny.gguf")
    refused(capsys, ["gguf", src, "-o", str(world / "home"), "--force"], "home folder")
    assert tree(world) == before


def test_its_own_output_is_replaced_but_not_once_a_user_added_to_it(world, capsys):
    work = world / "home" / "work"
    assert main(_gguf("out")) == 0
    made = json.loads((work / "out" / "made_from.json").read_text())
    assert made["made_by"] == "clp-mlx" and "model.safetensors" in made["files"]
    assert main(_gguf("out") + ["--dtype", "float32"]) == 0  # ours: replaced
    assert json.loads((work / "out" / "made_from.json").read_text())["dtype"] == "float32"
    for extra in ("thesis.tex", "sub/"):
        path = work / "out" / extra.rstrip("/")
        path.mkdir() if extra.endswith("/") else path.write_text("user's")
        before = tree(world)
        refused(capsys, _gguf("out"), "holds files clp-mlx did not write")
        assert tree(world) == before
        path.rmdir() if extra.endswith("/") else path.unlink()
    (work / "out" / "made_from.json").write_text("[1, 2]")  # a marker that is not ours
    refused(capsys, _gguf("out"), "not a folder clp-mlx wrote")
    (work / "empty").mkdir()
    assert main(_gguf("empty")) == 0  # an empty folder: nothing to lose


def test_hf_converter_keeps_the_source_and_its_parents(world, capsys, monkeypatch):
    make_hf_folder(world / "hf" / "model")
    monkeypatch.chdir(world / "elsewhere")
    before = tree(world)
    for out in (world / "hf" / "model", world / "hf"):
        refused(capsys, ["hf", str(world / "hf" / "model"), "-o", str(out), "--force"], "the input")
    assert tree(world) == before


def test_heads_force_replaces_only_heads(world, capsys, monkeypatch):
    model = tiny_model(0)
    _mlx_folder(world / "backbone", model)
    save_torch_file(world / "medusa.pt", medusa_state(2))
    monkeypatch.chdir(world / "elsewhere")
    argv = ["heads-from-torch", str(world / "medusa.pt"), "--model", str(world / "backbone")]
    assert main([*argv, "-o", str(world / "heads")]) == 0
    assert main([*argv, "-o", str(world / "heads"), "--force"]) == 0  # heads: replaced
    before = tree(world)
    refused(capsys, [*argv, "-o", str(world / "backbone"), "--force"], "the input")
    refused(capsys, [*argv, "-o", str(world / "elsewhere"), "--force"], "current folder")
    (world / "heads" / "notes.md").write_text("mine")
    refused(capsys, [*argv, "-o", str(world / "heads"), "--force"], "not a folder clp-mlx wrote")
    assert tree(world) == {**before, "heads/notes.md": tree(world)["heads/notes.md"]}


def test_the_atomic_writer_itself_never_replaces_the_cwd_a_file_or_a_link(world, monkeypatch):
    """The last line of defence for every writer (heads, training, packaging)."""
    from clp_mlx.paths import atomic_folder

    work = world / "home" / "work"
    (work / "link").symlink_to(world / "elsewhere")
    before = tree(world)
    for target, why in [(".", "current folder"), ("..", "current folder"), ("notes.txt", "not a folder"),
                        ("link", "symbolic link"), (str(world / "home"), "current folder")]:
        with pytest.raises(FileExistsError, match=why), atomic_folder(target) as tmp:
            (tmp / "x").write_text("new")
    with pytest.raises(FileExistsError, match="not a folder clp-mlx wrote"):
        with atomic_folder(world / "elsewhere", ours=lambda f: False):
            pass
    assert tree(world) == before
    with atomic_folder("models") as tmp:  # an empty folder: replaced, with a name from "."
        (tmp / "x").write_text("new")
    assert (work / "models" / "x").read_text() == "new"
