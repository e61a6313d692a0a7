"""generate's prompt and stop flags as mlx_lm.generate's: the escapes in -p,
--prefill-response, --system-prompt, --chat-template-config,
--extra-eos-token; and --max-kv-size and --prefill-step-size."""

import io
import sys

import pytest
from conftest import tiny_model, write_model_folder
from test_chat import write_chat_model
from test_cli_parity import MISSING, gen, mlx_generate, run

from clp_mlx.cli import generate
from clp_mlx.cli.prompt import prompt_ids, template_config
from clp_mlx.decode import loop


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("prompt") / "plain", tiny_model(0))


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("prompt") / "chat")


class FakeTokenizer:
    bos_token = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        self.text, self.special = text, add_special_tokens
        return [1, 2]


class TemplateTokenizer(FakeTokenizer):
    chat_template = "a template"

    def apply_chat_template(self, messages, **kw):
        self.messages, self.kw = messages, kw
        return "rendered"


def test_escapes_in_p_as_mlx_lm_not_in_stdin(monkeypatch):
    p = generate.setup_arg_parser()
    tok = FakeTokenizer()
    prompt_ids(p.parse_args(["-p", "a\\nb\\tc\\x"]), tok, {})
    assert tok.text == "a\nb\tc\\x" and tok.special
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\\ny"))
    prompt_ids(p.parse_args(["-p", "-"]), tok, {})
    assert tok.text == "x\\ny"


def test_a_newline_escape_reaches_the_model(templated, capsys, monkeypatch):
    seen = spy(monkeypatch)
    gen(templated, "--ignore-chat-template", "-p", "a\\nb", "-m", "1", capsys=capsys)
    assert len(seen["ids"]) == 3  # a, newline, b


def test_prefill_response_system_prompt_and_template_config_as_mlx_lm():
    argv = ["-p", "hi", "--system-prompt", "s", "--prefill-response", "Sure",
            "--chat-template-config", '{"enable_thinking": false}']  # fmt: skip
    args = generate.setup_arg_parser().parse_args(argv)
    tok = TemplateTokenizer()
    assert prompt_ids(args, tok, template_config(args.chat_template_config)) == [1, 2]
    assert tok.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Sure"},
    ]
    assert tok.kw == {
        "tokenize": False,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "enable_thinking": False,
    }
    assert tok.text == "rendered" and not tok.special


@pytest.mark.parametrize(
    "config, match",
    [("{oops", "not valid JSON"), ("[1]", "must be a JSON object"), ('{"tokenize": 1}', "cannot set")],
)
def test_a_bad_template_config_is_one_line(config, match, capsys):
    rc, _, err = run(generate.main, ["--model", MISSING, "--chat-template-config", config], capsys)
    assert rc == 1 and err.count("\n") == 1 and match in err, err


def spy(monkeypatch) -> dict:
    """Record the prompt ids and the tokens generate's stream_generate gives."""
    seen = {"tokens": []}
    real = generate.stream_generate

    def wrapped(model, tokenizer, ids, *a, **kw):
        seen["ids"] = list(ids)
        for r in real(model, tokenizer, ids, *a, **kw):
            seen["tokens"].append(r.token)
            seen["reason"] = r.finish_reason
            yield r

    monkeypatch.setattr(generate, "stream_generate", wrapped)
    return seen


def test_extra_eos_tokens_stop_the_generation(templated, capsys, monkeypatch):
    seen = spy(monkeypatch)
    flags = ("--ignore-chat-template", "-p", "hi", "-m", "8")
    gen(templated, *flags, capsys=capsys)
    tokens = list(seen["tokens"])
    assert seen["reason"] == "length" and len(tokens) == 8
    stop = tokens[2]
    first = tokens.index(stop)
    for spelled in (str(stop), mlx_generate.load(str(templated))[1].convert_ids_to_tokens(stop)):
        seen["tokens"].clear()
        gen(templated, *flags, "--extra-eos-token", "<|im_start|>", spelled, capsys=capsys)
        assert seen["tokens"] == tokens[:first] + [stop] and seen["reason"] == "stop"
    _, err = gen(templated, *flags, "--extra-eos-token", "<|nope|>", capsys=capsys, rc=1)
    assert "--extra-eos-token '<|nope|>' is not a token" in err


def test_max_kv_size_must_hold_the_prompt_and_the_answer(plain, capsys):
    _, err = gen(plain, "-p", "abcd", "-m", "8", "--max-kv-size", "11", capsys=capsys, rc=1)
    assert "do not fit in --max-kv-size 11" in err and err.count("\n") == 1
    gen(plain, "-p", "abcd", "-m", "8", "--max-kv-size", "12", capsys=capsys)
    _, err = gen(plain, "--max-kv-size", "1", capsys=capsys, rc=1)
    assert "at least 2" in err


def test_prefill_step_size_chunks_the_prompt(plain, capsys, monkeypatch):
    sizes = []
    real = loop.hidden_states

    def counting(model, tokens, cache):
        sizes.append(tokens.size)
        return real(model, tokens, cache)

    monkeypatch.setattr(loop, "hidden_states", counting)
    flags = ("-p", "abcdef", "-m", "4", "--mode", "ar", "--verbose", "False")
    out, _ = gen(plain, *flags, "--prefill-step-size", "2", capsys=capsys)
    assert sizes[:3] == [2, 2, 1] and loop.PREFILL_STEP == 2048
    assert gen(plain, *flags, capsys=capsys)[0] == out
    _, err = gen(plain, "--prefill-step-size", "0", capsys=capsys, rc=1)
    assert "at least 1" in err
