"""generate and chat take mlx-lm 0.32's flags: every flag of mlx_lm.generate's
and mlx_lm.chat's own parsers is taken (with mlx-lm's default) or refused in
one line naming it; the chat template, --verbose, --min-p, --seed and
--draft-model behave as mlx-lm's, and --draft-len is clp-mlx's drafts per
step (the prompt flags: test_cli_prompt.py)."""

import argparse
import importlib
import re

import mlx.core as mx
import pytest
from conftest import tiny_model, write_model_folder
from test_chat import DEFAULT_SYSTEM, n_tokens, write_chat_model

from clp_mlx.cli import chat, generate
from clp_mlx.cli.args import decode_config, guarded

mlx_chat = importlib.import_module("mlx_lm.chat")  # the modules, not the functions
mlx_generate = importlib.import_module("mlx_lm.generate")
MISSING = "/nonexistent-clp-parity/model"
REFUSED = {
    "generate": {"--adapter-path", "--image", "--xtc-probability", "--xtc-threshold",
                 "--min-tokens-to-keep", "--prompt-cache-file", "--quantize-activations",
                 "--kv-bits", "--kv-group-size", "--quantized-kv-start"},
    "chat": {"--adapter-path", "--xtc-probability", "--xtc-threshold", "--pipeline"},
}  # fmt: skip
# Defaults that differ from mlx-lm's on purpose (docs/FLAGS.md).
OWN_DEFAULTS = {"generate": {"num_draft_tokens"}, "chat": {"model"}}
COMMANDS = {"generate": (mlx_generate, generate), "chat": (mlx_chat, chat)}
VALUES = {"model": MISSING, "draft_model": MISSING + "-draft", "chat_template_config": '{"x": 1}'}


def mlx_lm_actions(command):
    for action in COMMANDS[command][0].setup_arg_parser()._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def long_name(action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def sample(action) -> list[str]:
    """A value for ``action`` other than its default, valid for a flag clp-mlx takes."""
    if action.nargs == 0:
        return []
    if action.dest in VALUES:
        return [VALUES[action.dest]]
    if action.type is int:
        return ["3" if action.default == 2 else "2"]
    if action.type is float:
        return ["0.5"]
    return ["False"] if action.type is mlx_generate.str2bool else ["x"]


CASES = [(c, o, a) for c in COMMANDS for a in mlx_lm_actions(c) for o in a.option_strings]


def run(main, argv, capsys):
    argv = [str(a) for a in argv]
    rc = guarded(lambda: main(argv), argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("command, option, action", CASES, ids=[f"{c}{o}" for c, o, _ in CASES])
def test_every_mlx_lm_flag_is_taken_or_refused_in_one_line(command, option, action, capsys):
    argv = [option, *sample(action)]
    if action.dest != "model":
        argv = ["--model", MISSING, *argv]
    rc, _, err = run(COMMANDS[command][1].main, argv, capsys)  # an unknown flag: SystemExit
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: "), err
    name = long_name(action)
    if name in REFUSED[command]:
        assert err.startswith(f"error: {name} is not supported by clp-mlx: "), err
    else:  # taken: only the missing model stopped it
        assert MISSING in err and "not supported" not in err, err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_taken_flags_have_mlx_lms_defaults_refused_ones_take_them(command, capsys):
    ours = COMMANDS[command][1].setup_arg_parser()
    defaults = []
    for action in mlx_lm_actions(command):
        name = long_name(action)
        if name in REFUSED[command]:  # given mlx-lm's default, a refused flag asks for nothing
            if action.nargs != 0 and action.default not in (None, ()):
                defaults += [name, str(action.default)]
        elif action.dest not in OWN_DEFAULTS[command]:
            assert ours.get_default(action.dest) == action.default, name
    rc, _, err = run(COMMANDS[command][1].main, ["--model", MISSING, *defaults], capsys)
    assert rc == 1 and MISSING in err and "not supported" not in err, err


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("parity") / "plain", tiny_model(0))


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("parity") / "chat")


def gen(folder, *flags, capsys, rc=0):
    got, out, err = run(generate.main, ["--model", folder, "--drafter", "none", *flags], capsys)
    assert got == rc, err
    return out, err


def prompt_count(out: str) -> int:
    return int(re.search(r"^Prompt: (\d+) tokens", out, re.MULTILINE).group(1))


def test_the_chat_template_is_on_by_default(templated, capsys):
    out, _ = gen(templated, "-p", "hi", "-m", "3", capsys=capsys)
    rendered = DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_count(out) == n_tokens(rendered)
    out, _ = gen(templated, "-p", "hi", "-m", "3", "--ignore-chat-template", capsys=capsys)
    assert prompt_count(out) == 2
    out, _ = gen(templated, "-p", "hi", "-m", "3", "--chat-template", capsys=capsys)  # old, no-op
    assert prompt_count(out) == n_tokens(rendered)


def test_flags_that_need_the_template_say_so(plain, templated, capsys):
    _, err = gen(plain, "--system-prompt", "s", capsys=capsys, rc=1)
    assert "--system-prompt needs the chat template, and this model has none" in err
    _, err = gen(templated, "--ignore-chat-template", "--prefill-response", "x", capsys=capsys, rc=1)
    assert "--ignore-chat-template turns it off" in err
    _, err = gen(plain, "--use-default-chat-template", capsys=capsys, rc=1)
    assert "no default chat template" in err
    out, _ = gen(plain, "--chat-template", "-m", "2", capsys=capsys)  # old flag: raw prompt
    assert prompt_count(out) == len("hello")


def test_verbose_true_frames_the_text_false_prints_it_alone(templated, capsys):
    flags = ("-p", "hi", "-m", "6")
    loud, _ = gen(templated, *flags, capsys=capsys)
    assert loud.startswith("=" * 10 + "\n") and "\n" + "=" * 10 + "\nPrompt: " in loud
    text = loud[11 : loud.index("\n" + "=" * 10 + "\nPrompt")]
    for value in ("False", "f", "FALSE"):
        quiet, err = gen(templated, *flags, "--verbose", value, capsys=capsys)
        assert quiet == text + "\n" and not err
    alone, _ = gen(templated, *flags, "--verbose", capsys=capsys)  # no value: True
    assert alone.startswith(loud[: loud.index("Prompt: ")])
    p = generate.setup_arg_parser()
    assert p.parse_args(["--verbose"]).verbose and p.parse_args(["--verbose", "T"]).verbose
    with pytest.raises(SystemExit):
        p.parse_args(["--verbose", "maybe"])


def test_min_p_reaches_sampling_and_changes_nothing_greedy(plain, capsys):
    p = generate.setup_arg_parser()
    assert decode_config(p.parse_args(["--min-p", "0.25"])).sampling.min_p == 0.25
    flags = ("-p", "ab", "-m", "8", "--verbose", "False")
    assert gen(plain, *flags, capsys=capsys) == gen(plain, *flags, "--min-p", "0.9", capsys=capsys)


def test_no_seed_draws_afresh_a_seed_repeats(plain, capsys, monkeypatch):
    assert decode_config(generate.setup_arg_parser().parse_args([])).sampling.seed is None
    assert chat.setup_arg_parser().parse_args([]).seed == 0  # mlx_lm.chat's default
    flags = ("-p", "ab", "-m", "24", "--temp", "100", "--mode", "ar", "--verbose", "False")
    outs = []
    for global_seed in (1, 2):  # what a fresh process draws, made deterministic
        mx.random.seed(global_seed)
        outs.append(gen(plain, *flags, capsys=capsys)[0])
    assert outs[0] != outs[1]
    seeded = []
    for global_seed in (1, 2):
        mx.random.seed(global_seed)
        seeded.append(gen(plain, *flags, "--seed", "7", capsys=capsys)[0])
    assert seeded[0] == seeded[1]
    seen = {}

    def fake_load(model, heads, **kw):  # --drafter init without --seed: seed 0
        seen.update(kw)
        raise generate.ClpError("stop here")

    monkeypatch.setattr("clp_mlx.api.load_with_drafter", fake_load)
    run(generate.main, ["--drafter", "init"], capsys)
    assert seen["seed"] == 0


def test_draft_model_runs_mlx_lms_speculative_decoding(plain, capsys):
    model, tokenizer = mlx_generate.load(str(plain))
    want = mlx_generate.generate(model, tokenizer, tokenizer.encode("ab"), max_tokens=8)
    argv = ["--model", plain, "--draft-model", plain, "-p", "ab", "-m", "8"]
    rc, out, err = run(generate.main, [*argv, "--verbose", "False"], capsys)
    assert rc == 0 and out == want + "\n", err
    rc, out, _ = run(generate.main, [*argv, "--num-draft-tokens", "2"], capsys)
    assert rc == 0 and "Draft model: " in out and want in out
    for flag in (["--mode", "ar"], ["--draft-len", "2"], ["--drafter", "none"]):
        rc, _, err = run(generate.main, [*argv, *flag], capsys)
        assert rc == 1 and f"{flag[0]} is for clp-mlx's own decoding" in err
    rc, _, err = run(generate.main, [*argv, "--num-draft-tokens", "0"], capsys)
    assert rc == 1 and "--num-draft-tokens must be at least 1" in err


def test_draft_len_and_its_old_name(plain, capsys):
    _, err = gen(plain, "--draft-len", "0", capsys=capsys, rc=1)
    assert "--draft-len" in err and "--num-draft-tokens" not in err
    _, err = gen(plain, "--num-draft-tokens", "0", capsys=capsys, rc=1)
    assert "--draft-len" in err  # the old name, without --draft-model, means the same
    _, err = gen(plain, "--draft-len", "2", "--num-draft-tokens", "2", capsys=capsys, rc=1)
    assert "not both" in err
