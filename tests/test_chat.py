"""The chat: turns from the template, the cache across turns, and the REPL
driven like a person (pexpect, on a tiny model folder with a chat template)."""

import json
import re
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

try:
    import pexpect
except ImportError:  # the REPL tests need the test extra
    pexpect = None
from conftest import tiny_model
from mlx_lm.models.cache import make_prompt_cache

from clp_mlx.cli import chat
from clp_mlx.model.backbone import hidden_states, load_backbone, project
from clp_mlx.model.heads_files import init_heads

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's template without tools: a default system message when none is given.
TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a tiny model.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a tiny model.<|im_end|>\n"


def n_tokens(text: str) -> int:
    """Tokens of ``text`` for the byte tokenizer: one per byte or special token."""
    for s in SPECIALS:
        text = text.replace(s, "\0")
    return len(text.encode())


def byte_char(b: int) -> str:
    """The character a byte-level BPE writes for byte ``b``: printable Latin-1
    bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return chr(b) if b in printable else chr(256 + sum(c not in printable for c in range(b)))


def write_chat_model(folder: Path, ends: bool = False) -> Path:
    """A tiny Qwen2 folder with a byte tokenizer and a ChatML template.

    Unless ``ends``, the output rows of the special tokens are zero: greedy
    decoding never ends an answer, so answers run to --max-tokens (or Ctrl-C).
    """
    from mlx_lm.utils import save_model
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = tiny_model(0, tied=False)
    if not ends:
        model.lm_head.weight[125:] = 0.0
        mx.eval(model.parameters())
    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(dict(model.args.__dict__)))

    # Newline, printable ASCII, then Latin-1 bytes up to 125 byte tokens.
    chosen = [10, *range(32, 127), *range(161, 161 + 125 - 96)]
    vocab = {byte_char(b): i for i, b in enumerate(chosen)}
    vocab.update({s: 125 + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="module")
def loaded(folder):
    return load_backbone(folder)


def test_turns_are_cut_from_the_template(loaded):
    model, tokenizer = loaded
    assert chat.template_pieces(tokenizer) == (
        "<|im_end|>\n",
        "<|im_start|>user\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    conv = chat.Conversation(model, tokenizer)
    first = conv.begin_turn("hi")
    assert (
        tokenizer.decode(first)
        == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    conv.tokens += first + tokenizer.encode("yo")  # an answer cut short: closed with <|im_end|>
    assert tokenizer.decode(conv.begin_turn("more")) == (
        "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
    conv.tokens.append(tokenizer.eos_token_id)  # ended by the model: only the newline is missing
    assert tokenizer.decode(conv.begin_turn("more")).startswith("\n<|im_start|>user\n")
    with_system = chat.Conversation(model, tokenizer, "Be brief.")
    assert tokenizer.decode(with_system.begin_turn("hi")).startswith(
        "<|im_start|>system\nBe brief."
    )


def cache_matches_a_fresh_prefill(model, conv) -> bool:
    """The conversation's cache gives the logits a cache of its tokens gives."""
    probe = mx.array([40, 41, 42])
    assert {c.offset for c in conv.cache} == {conv.cached}
    got = project(model, hidden_states(model, probe, conv.cache))
    for c in conv.cache:
        c.trim(probe.size)
    fresh = make_prompt_cache(model)
    seq = mx.array(conv.tokens[: conv.cached] + probe.tolist())
    want = project(model, hidden_states(model, seq, fresh)[-probe.size :])
    return mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def interrupting(stream_generate, after: list, presses: int = 1):
    """stream_generate that sends Ctrl-C (SIGINT) after the given token counts."""

    def wrapper(*args, **kwargs):
        stop = after.pop(0) if after else None
        for i, r in enumerate(stream_generate(*args, **kwargs)):
            if i == stop:
                for _ in range(presses):
                    signal.raise_signal(signal.SIGINT)
            yield r

    return wrapper


@pytest.mark.parametrize("mode", ["ar", "verify", "fixed", "clp"])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_cache_holds_exactly_the_committed_tokens(loaded, monkeypatch, capsys, mode, temp):
    model, tokenizer = loaded
    heads = init_heads(model, 3, seed=0) if mode == "verify" else None
    if mode in ("fixed", "clp"):
        from conftest import random_heads

        heads = random_heads(model, 3, seed=1, scale=0.5)
    # top-k 20 keeps the zero-logit special tokens out: answers never end by themselves.
    argv = ["-m", "9", "--temp", str(temp), "--top-k", "20", "--mode", mode]
    config = chat.decode_config(chat.setup_arg_parser().parse_args(argv))
    conv = chat.Conversation(model, tokenizer)
    # Ctrl-C after 0, 4 and 7 tokens on turns 2-4; turns 1 and 5 run to -m 9.
    stops = [None, 0, 4, 7, None]
    mx.random.seed(0)
    unfed_before = 0
    monkeypatch.setattr(chat, "stream_generate", interrupting(chat.stream_generate, stops))
    for turn in range(5):
        before = len(conv.tokens)
        chat.answer(conv, f"question {turn}", config, heads, limit=10_000)
        out = capsys.readouterr().out
        assert ("[interrupted]" in out) == (turn in (1, 2, 3)), out
        new, carried, last = conv.turns[-1]
        assert len(conv.tokens) == before + new + last.generation_tokens
        assert len(conv.unfed) <= 4  # at most the last step's committed tokens
        if turn in (0, 4):  # ran to -m: the last token was committed, never fed
            assert len(conv.unfed) >= 1
        assert cache_matches_a_fresh_prefill(model, conv), (mode, turn)
        if turn:
            assert carried == unfed_before
        unfed_before = len(conv.unfed)


def test_a_second_ctrl_c_inside_a_pass_leaves_a_usable_cache(loaded, monkeypatch, capsys):
    """A KeyboardInterrupt between two layers: each layer is trimmed on its own."""
    model, tokenizer = loaded
    config = chat.decode_config(chat.setup_arg_parser().parse_args(["-m", "6", "--mode", "ar"]))
    conv = chat.Conversation(model, tokenizer)
    chat.answer(conv, "first", config, None, limit=10_000)
    layers = model.model.layers
    real = layers[1]

    class Interrupted:
        def __call__(self, *a, **kw):
            raise KeyboardInterrupt

    layers[1] = Interrupted()  # layer 0 takes the new tokens, layer 1 never does
    try:
        chat.answer(conv, "second", config, None, limit=10_000)
    finally:
        layers[1] = real
    assert "[interrupted]" in capsys.readouterr().out
    assert cache_matches_a_fresh_prefill(model, conv)
    chat.answer(conv, "third", config, None, limit=10_000)
    assert cache_matches_a_fresh_prefill(model, conv)


STATS = re.compile(r"\[prefill (\d+) tokens \((\d+) new \+ (\d+) carried over\)")


def spawn(folder, *flags):
    env = {"TERM": "dumb", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}
    argv = ["-m", "clp_mlx.chat", "--model", str(folder), "--heads", "init", *flags]
    # Ctrl-C as at a terminal even when the tests run as a background job, whose
    # children start with SIGINT ignored (and Python then never raises KeyboardInterrupt).
    child = pexpect.spawn(
        sys.executable, argv, cwd=str(REPO), env=env, timeout=60, encoding="utf-8",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.expect(r"q or Ctrl-D to quit\]")
    child.expect(">> ")
    return child


def ask(child, text):
    """Send a turn; return (prefill, new, carried) from the printed statistics."""
    child.sendline(text)
    child.expect(STATS)
    prefill, new, carried = (int(g) for g in child.match.groups())
    child.expect(">> ")
    return prefill, new, carried


def turn(text, closed=False):
    """A later turn's text: closing the last answer (unless it ended itself) to the reply."""
    close = "\n" if closed else "<|im_end|>\n"
    return f"{close}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


needs_pexpect = pytest.mark.skipif(pexpect is None, reason="needs pexpect (the test extra)")


@needs_pexpect
def test_repl_turns_reset_and_a_full_context(folder):
    child = spawn(folder, "-m", "12", "--max-kv-size", "300")
    first = DEFAULT_SYSTEM + "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert ask(child, "hello there") == (n_tokens(first), n_tokens(first), 0)
    # The second turn prefills its own tokens, plus the answer's last token,
    # which was committed but not fed; no system message again.
    prefill, new, carried = ask(child, "second question")
    assert new == n_tokens(turn("second question")) and carried == 1
    assert prefill == new + carried
    child.sendline("s")
    child.expect(r"2 turns, (\d+) of 300 tokens in the context")
    assert int(child.match.group(1)) == n_tokens(first) + 12 + new + 12
    child.expect("all turns")
    child.sendline("r")
    child.expect(r"\[new conversation\]")
    assert ask(child, "hello there")[1] == n_tokens(first)
    child.sendline("x" * 300)  # does not fit: refused, the conversation stays
    child.expect("type r to start over")
    child.expect(">> ")
    assert ask(child, "ok")[1:] == (n_tokens(turn("ok")), 1)
    child.sendline("/mode nope")
    child.expect("unknown mode")
    child.sendline("/mode ar")
    child.expect(r"\[mode ar\]")
    assert ask(child, "in ar")[1] == n_tokens(turn("in ar"))
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@needs_pexpect
def test_repl_ctrl_c_stops_an_answer_and_keeps_the_conversation(folder):
    flags = ("-m", "100000", "--temp", "0.7", "--top-k", "20", "--mode", "verify")
    child = spawn(folder, *flags)
    for text in ("tell me everything", "go on"):
        child.sendline(text)
        child.expect_exact(text)  # the echo; the answer streams after it
        time.sleep(1.0)
        child.sendintr()
        child.expect(r"\[interrupted\]")
        child.expect(re.compile(STATS.pattern + r" \| (\d+) tokens"))
        _, new, carried, answered = (int(g) for g in child.match.groups())
        child.expect(">> ")
        assert 10 < answered < 100000  # stopped mid-answer
        if text == "go on":
            assert new == n_tokens(turn("go on")) and carried <= 4
    child.sendintr()  # Ctrl-C at the prompt drops the line and keeps the conversation
    child.expect(">> ")
    child.sendline("s")
    child.expect("2 turns")
    child.sendline("q")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
