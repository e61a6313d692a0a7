"""Every command meets bad input with one line ``error: ...`` and status 1;
a traceback only with --debug (or for a bug); Ctrl-C gives 130."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model, write_model_folder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chat import write_chat_model

from clp_mlx import api
from clp_mlx.cli import bench, bench_step, chat, convert, distill, generate, train
from clp_mlx.cli.args import guarded
from clp_mlx.errors import ClpError
from clp_mlx.model.backbone import load_backbone

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("cli") / "tiny", tiny_model(0))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("chat") / "tiny")


def one_error(main, argv, capsys, match: str = "") -> str:
    """Run a command as its ``cli()`` does; the one error line it printed."""
    assert guarded(lambda: main(argv), argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err
    return err


def broken(folder: Path, where: Path, config=None, raw: bytes | None = None) -> Path:
    """A copy of the model folder with config.json changed or replaced by raw bytes."""
    shutil.copytree(folder, where)
    if config is not None:
        old = json.loads((folder / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**old, **config}))
    if raw is not None:
        (where / "config.json").write_bytes(raw)
    return where


CONFIGS = {
    "foreign": {"model_type": "llama"},
    "unknown type": {"model_type": "nope"},
    "no type": {"model_type": None},
    "string size": {"hidden_size": "64"},
    "negative vocab": {"vocab_size": -5},
    "wrong vocab": {"vocab_size": 1000},
    "bool layers": {"num_hidden_layers": True},
    "huge layers": {"num_hidden_layers": 10**7},
    "zero heads": {"num_attention_heads": 0},
}
RAW = {"not json": b"{oops", "a list": b"[1, 2]", "not utf-8": b"\xff\xfe{}", "empty": b""}


@pytest.mark.parametrize("case", [*CONFIGS, *RAW])
def test_a_broken_model_folder_is_one_line(folder, tmp_path, capsys, case):
    bad = broken(folder, tmp_path / "m", CONFIGS.get(case), RAW.get(case))
    one_error(generate.main, ["--model", str(bad), "-p", "hi"], capsys, str(bad))


def test_broken_weights_and_tokenizer_are_one_line(folder, tmp_path, capsys):
    bad = broken(folder, tmp_path / "w")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    one_error(generate.main, ["--model", str(bad), "-p", "hi"], capsys, str(bad))
    bad = broken(folder, tmp_path / "t")
    (bad / "tokenizer.json").write_text("{")
    one_error(generate.main, ["--model", str(bad), "-p", "hi"], capsys, str(bad))


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    small = write_model_folder(tmp_path / "small", tiny_model(0, vocab=100))  # 128 tokens
    one_error(generate.main, ["--model", str(small), "-p", "hi"], capsys, "tokenizer has 128")


def every_command(bad: Path, tmp_path: Path) -> dict:
    text = tmp_path / "data.txt"
    text.write_text(" = T = \n\n some text to continue .\n")
    return {
        generate.main: ["-p", "hi"],
        chat.main: [],
        train.main: ["--data", str(text), "--out", str(tmp_path / "out")],
        bench.main: ["--prompts", str(text)],
        bench_step.main: [],
        distill.main: ["--out", str(tmp_path / "d"), "--kind", "wikitext", "--data", str(text),
                       "--prompts", "2"],  # fmt: skip
    }


def test_every_command_is_one_line_and_takes_debug(folder, tmp_path, capsys):
    bad = broken(folder, tmp_path / "m", {"model_type": "llama"})
    for main, argv in every_command(bad, tmp_path).items():
        argv = ["--model", str(bad), *argv]
        one_error(main, argv, capsys, "llama")
        with pytest.raises(ClpError, match="llama"):  # --debug: the traceback, for bug reports
            guarded(lambda: main([*argv, "--debug"]), [*argv, "--debug"])


def test_convert_is_one_line_and_takes_debug_after_its_subcommand(tmp_path, capsys):
    argv = ["heads-to-package", str(tmp_path / "none"), "qwen2.5-coder-0.5b-instruct"]
    one_error(convert.main, argv, capsys, "holds no heads")
    for debug in ([*argv, "--debug"], ["--debug", *argv]):
        with pytest.raises(ClpError, match="holds no heads"):
            convert.main(debug)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "", "-p", "hi"], "model is empty"),
        (["-p", "hi", "--mode", "ar", "--num-draft-tokens", "2"], "mode ar"),
        (["-p", "hi", "--heads", ""], "heads is empty"),
        (["-p", "hi", "--seed", "-1"], "seed"),
        (["-p", "hi", "--top-k", "-2"], "top_k"),
        (["-p", "caf\udce9"], "not valid UTF-8"),
        (["-p", "hi", "--chat-template", "--system-prompt", "\udcff"], "--system-prompt"),
        (["-p", "x" * 40], "context holds 16"),
    ],
)
def test_generate_refuses_bad_input_with_one_line(folder, tmp_path, capsys, argv, match):
    short = broken(folder, tmp_path / "short", {"max_position_embeddings": 16})
    one_error(generate.main, ["--model", str(short), *argv], capsys, match)


def test_unwritable_output_is_one_line_with_the_path(folder, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    text = tmp_path / "data.txt"
    text.write_text("some text to learn from, again and again. " * 20)
    out = tmp_path / "file" / "heads"
    argv = ["--model", str(folder), "--data", str(text), "--out", str(out), "--steps", "1"]
    one_error(train.main, argv, capsys, str(tmp_path / "file"))


def test_train_refuses_to_replace_a_foreign_folder_before_training(folder, tmp_path, capsys):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    text = tmp_path / "data.txt"
    text.write_text("some text")
    for out in (tmp_path / "foreign", tmp_path):
        argv = ["--model", str(folder), "--data", str(text), "--out", str(out), "--force"]
        one_error(train.main, argv, capsys, "will not replace")
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"


def test_guarded_turns_only_foreseen_errors_into_lines(capsys):
    def raising(e):
        def main():
            raise e

        return main

    cases = {
        PermissionError(13, "Permission denied", "/root/x"): "error: Permission denied: /root/x\n",
        RuntimeError("[load_safetensors] bad offsets"): "error: cannot read a file: [load_safetensors] bad offsets\n",
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"): "not valid UTF-8",
        ClpError("a clear line"): "error: a clear line\n",
    }
    for e, line in cases.items():
        assert guarded(raising(e), []) == 1
        assert line in capsys.readouterr().err
    assert guarded(raising(KeyboardInterrupt()), []) == 130
    for bug in (ZeroDivisionError(), RuntimeError("not a file error"), KeyError("k")):
        with pytest.raises(type(bug)):
            guarded(raising(bug), [])
    with pytest.raises(ClpError):
        guarded(raising(ClpError("x")), ["--debug"])


def run_chat(monkeypatch, capsys, argv, lines) -> str:
    feed = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    assert chat.main(argv) == 0
    return capsys.readouterr().out


def test_chat_answers_unknown_commands_and_bad_lines(chat_folder, monkeypatch, capsys):
    argv = ["--model", str(chat_folder), "--heads", "init", "-m", "3", "--num-draft-tokens", "2"]
    lines = ["/foo", "/mode turbo", "hi\udcff", "/mode ar", "//slash", "/mode verify", "hi", "q"]
    out = run_chat(monkeypatch, capsys, argv, lines)
    assert "[unknown command /foo" in out and "[unknown mode 'turbo'" in out
    assert "[error: this message is not valid UTF-8" in out
    assert "[mode ar]" in out and "[mode verify]" in out and out.count("tokens per backbone pass") == 2


def test_chat_refuses_a_kv_size_past_the_context(chat_folder, capsys):
    with pytest.raises(ClpError, match="more than this model's context"):
        chat.main(["--model", str(chat_folder), "--max-kv-size", str(10**9)])


def test_non_utf8_standard_input_is_one_line(folder):
    cmd = [sys.executable, "-m", "clp_mlx.generate", "--model", str(folder), "-p", "-", "-m", "2"]
    out = subprocess.run(cmd, input=b"caf\xe9 \xff", capture_output=True, cwd=REPO)
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err and err.count("error:") == 1
    assert "UTF-8" in err
    ok = subprocess.run(cmd, input="café".encode(), capture_output=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr.decode()
    # stdin closed: no prompt to read, and the weights (opened as descriptor 0) still load
    closed = subprocess.run(cmd, capture_output=True, cwd=REPO, preexec_fn=lambda: os.close(0))
    assert closed.returncode == 1 and b"no standard input" in closed.stderr, closed.stderr


config_values = st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats() | st.text(max_size=4)
CONFIG_KEYS = [
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "max_position_embeddings", "rope_theta",
    "rms_norm_eps", "tie_word_embeddings", "rope_scaling", "model_type", "rope_traditional",
]  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(CONFIG_KEYS), value=config_values)
def test_random_config_values_load_or_are_refused(folder, tmp_path, key, value):
    bad = tmp_path / "m"
    shutil.rmtree(bad, ignore_errors=True)
    broken(folder, bad, {key: value})
    try:
        model, tokenizer = load_backbone(bad)
        text = api.generate(model, tokenizer, "hi", max_tokens=2)  # a config that loads must run
    except ClpError:
        return
    assert model.args.vocab_size == 128 and isinstance(text, str)


@pytest.mark.parametrize("name", ["distill_all.sh", "eval_folders.sh"])
def test_the_data_scripts_meet_bad_arguments_with_one_line(name, tmp_path):
    script = Path(__file__).parents[1] / "examples" / name
    got = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert got.returncode != 0 and got.stdout == ""
    assert got.stderr.count("\n") == 1
    assert f"usage: {name} WIKITEXT_DIR OUT_ROOT" in got.stderr
    got = subprocess.run(["bash", str(script), "w", "o", "7b"], capture_output=True, text=True)
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "not '7b'" in got.stderr
    if name == "eval_folders.sh":  # a folder without WikiText-2: refused before any model loads
        got = subprocess.run(["bash", str(script), str(tmp_path), str(tmp_path / "o")],
                             capture_output=True, text=True)  # fmt: skip
        assert got.returncode == 2
        assert got.stderr == f"eval_folders.sh: no wiki.valid.raw in {tmp_path}\n"
        assert not (tmp_path / "o").exists()
