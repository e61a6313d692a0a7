"""``python -m clp_mlx.chat``: chat with a model in the terminal.

Answers stream as they are decoded. The KV cache is kept across turns, so a
turn prefills only its own tokens, plus the end of the last answer that no
pass has fed yet (its last token, or ``<|im_end|>``). Flags and the q/r/h
commands follow ``mlx_lm.chat``.

Turns: the first goes through the model's chat template (with
``--system-prompt``; without it Qwen2.5's template adds its default system
message). Later turns are built from pieces of the same template (what closes
an assistant message, what opens a user turn, what starts the reply), so no
system message is injected again.

An answer cut short (``--max-tokens``, Ctrl-C, a full context) is closed the
way the template closes every assistant message (``<|im_end|>`` and a newline
for Qwen) when the next turn starts: the model sees the partial answer as a
finished one, as if the conversation had been rendered with it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from dataclasses import replace

import mlx.core as mx

from ..api import stream_generate
from ..decode.config import MODES, DecodeConfig
from ..errors import ClpError
from ..model.tokens import prompt_ids
from .args import (
    add_decode_args,
    add_model_args,
    decode_config,
    load_model,
    no_drafter_note,
    parser,
    run,
)
from .conversation import Conversation, template_pieces, turn_line
from .mlx_lm_flags import (
    add_max_kv_size,
    add_prefill_step_size,
    add_refused,
    check_max_kv_size,
    check_prefill_step_size,
    kv_limit,
    prefill_step_size,
    refuse_unsupported,
)

__all__ = ["Conversation", "answer", "main", "template_pieces"]

HELP = f"""commands:
  q, /quit       leave (Ctrl-D too)
  r, /reset      start a new conversation
  s, /stats      statistics of this conversation
  /mode MODE     switch the decode mode: {", ".join(MODES)}
  h, /help       this help
A line starting with / is a command; start it with // to send it as text.
Ctrl-C stops an answer and keeps the conversation."""


@contextlib.contextmanager
def ctrl_c_stops_the_answer():
    """While answering, Ctrl-C sets the yielded event; a second one raises.

    The answer loop checks the event between tokens, so a single Ctrl-C never
    lands inside the model code.
    """
    pressed = threading.Event()

    def handler(signum, frame):
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def with_mode(config: DecodeConfig, mode: str, draft_len: int | None) -> DecodeConfig:
    """``config`` switched to ``mode``: ``ar`` drafts nothing, the others
    draft ``draft_len`` (--draft-len) again."""
    return replace(config, mode=mode, draft_len=None if mode == "ar" else draft_len)


def answer(conv: Conversation, text: str, config: DecodeConfig, heads, limit: int) -> None:
    """Stream one answer and print its statistics."""
    new = conv.begin_turn(text)
    room = limit - len(conv.tokens) - len(new)
    if room < 1:
        print(
            f"[this turn needs {len(new)} tokens and the context holds {len(conv.tokens)} "
            f"of {limit}: type r to start over]"
        )
        return
    carried = len(conv.unfed)
    prompt, _ = prompt_ids(conv.unfed + new, conv.model, conv.cached)  # before any change
    held = conv.tokens[: conv.cached]  # earlier turns, for context drafts to copy from
    conv.tokens += new
    max_tokens = min(config.max_tokens, room)
    last, interrupted = None, False
    turn = replace(config, max_tokens=max_tokens)
    stream = stream_generate(
        conv.model, conv.tokenizer, prompt, heads, config=turn, prompt_cache=conv.cache, context=held
    )
    with ctrl_c_stops_the_answer() as pressed, contextlib.closing(stream):
        try:
            for last in stream:
                conv.tokens.append(last.token)
                print(last.text, end="", flush=True)
                if pressed.is_set():
                    interrupted = True
                    break
        except KeyboardInterrupt:  # the second Ctrl-C
            interrupted = True
    conv.end_answer()
    print("\n[interrupted]" if interrupted else "")
    if last is not None:
        conv.turns.append((len(new), carried, last))
        print(f"[{turn_line(len(new), carried, last)} | context {len(conv.tokens)}/{limit}]")
        if last.finish_reason == "length" and max_tokens < config.max_tokens:
            print("[the context is full: type r to start over]")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = parser("python -m clp_mlx.chat", __doc__.split("\n")[0])
    add_model_args(p)
    add_decode_args(p, max_tokens=256, seed=0)
    # clp-mlx's old name for --draft-len (mlx_lm.chat has no draft model)
    p.add_argument("--num-draft-tokens", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--system-prompt", default=None, help="system message of the conversation")
    add_max_kv_size(p, "an answer stops when the conversation is full; r starts a new one")
    add_prefill_step_size(p)
    add_refused(p, "chat")
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    refuse_unsupported(args)
    # Each answer draws its sampling key from mx.random, seeded once here (as mlx_lm.chat).
    config = decode_config(args)
    config = replace(config, sampling=replace(config.sampling, seed=None))
    asked_len = config.draft_len  # drafts per step, for /mode to come back to
    check_max_kv_size(args.max_kv_size)
    check_prefill_step_size(args.prefill_step_size)
    mx.random.seed(args.seed)
    model, tokenizer, heads, resolved = load_model(args, config)
    if tokenizer.chat_template is None:
        raise ClpError("this model has no chat template; use clp_mlx.generate")
    config = replace(config, mode=resolved.mode)
    limit = kv_limit(args.max_kv_size, model)
    conv = Conversation(model, tokenizer, args.system_prompt, heads)
    sampling = f"temp {args.temp}, top-p {args.top_p}, min-p {args.min_p}, top-k {args.top_k}"
    k = resolved.draft_len or 0
    drafts = "" if heads is not None or not k else " context drafts"
    print(f"[mode {config.mode}, k={k}{drafts} | {sampling if args.temp else 'greedy'} | context {limit}]")
    note = no_drafter_note(args, heads, resolved)
    if note:
        print(f"[{note}]")
    print("[h for help, q or Ctrl-D to quit]")
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    while True:
        try:
            line = input(">> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # as in Python's REPL: drop the line, keep the conversation
            print()
            continue
        except UnicodeDecodeError:
            print("[error: that line is not valid UTF-8 text]")
            continue
        if line in ("q", "/quit"):
            return 0
        try:
            with prefill_step_size(args.prefill_step_size):
                config = command(line, conv, config, heads, limit, asked_len)
        except ClpError as e:  # this line's problem: the conversation goes on
            print(f"[error: {e}]")


def command(line: str, conv: Conversation, config, heads, limit: int, draft_len) -> DecodeConfig:
    """Do what one line asks (anything but quitting); the config for the next line."""
    word, _, rest = line.partition(" ")
    if line in ("r", "/reset"):
        conv.reset()
        print("[new conversation]")
    elif line in ("h", "/help"):
        print(HELP)
    elif line in ("s", "/stats"):
        print(conv.summary(limit))
    elif word == "/mode":
        try:
            wanted = with_mode(config, rest.strip() or config.mode, draft_len)
            wanted.resolve(conv.model, heads)  # why this mode cannot run, if it cannot
        except ClpError as e:
            print(f"[{e}]")
            return config
        config = wanted
        print(f"[mode {config.mode}]")
    elif line.startswith("/") and not line.startswith("//"):
        print(f"[unknown command {word}: h for help; start a message with // to send a /]")
    elif line:
        answer(conv, line[1:] if line.startswith("//") else line, config, heads, limit)
    return config


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
