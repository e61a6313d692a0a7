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
from mlx_lm.models.cache import make_prompt_cache

from ..api import Response, stream_generate
from ..decode.config import MODES, DecodeConfig
from ..errors import ClpError
from .args import add_decode_args, add_model_args, decode_config, load_model, run

HELP = f"""commands:
  q, /quit       leave (Ctrl-D too)
  r, /reset      start a new conversation
  s, /stats      statistics of this conversation
  /mode MODE     switch the decode mode: {", ".join(MODES)}
  h, /help       this help
Ctrl-C stops an answer and keeps the conversation."""
_MARK = "CLP-MLX-MARK-7f3a"  # placeholder content, to cut the template into pieces


def template_pieces(tokenizer) -> tuple[str, str, str]:
    """What closes an assistant message, opens a user turn, and starts the reply.

    For Qwen2.5: ``<|im_end|>\\n``, ``<|im_start|>user\\n`` and
    ``<|im_end|>\\n<|im_start|>assistant\\n``; cut from the model's own
    template by rendering placeholder conversations one turn apart.
    """

    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    head = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _MARK},
    ]
    before = render(head, False)
    after = render([*head, {"role": "user", "content": _MARK}], True)
    turn = after[len(before) :]
    if not after.startswith(before) or before.count(_MARK) != 1 or turn.count(_MARK) != 1:
        raise ClpError("cannot cut this model's chat template into turns")
    opening, reply = turn.split(_MARK)
    return before[before.index(_MARK) + len(_MARK) :], opening, reply


class Conversation:
    """A conversation's tokens and the KV cache that holds them.

    ``tokens``: every committed token, turns as the template renders them and
    answers as decoded. The cache holds the first ``cached`` of them; the
    rest (``unfed``) go in with the next turn.
    """

    def __init__(self, model, tokenizer, system_prompt: str | None = None):
        self.model, self.tokenizer, self.system_prompt = model, tokenizer, system_prompt
        self.close, self.opening, self.reply = template_pieces(tokenizer)
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.cache = make_prompt_cache(self.model)
        self.turns: list[tuple[int, int, Response]] = []  # (new, carried over, last response)

    @property
    def cached(self) -> int:
        return min(c.offset for c in self.cache)

    @property
    def unfed(self) -> list[int]:
        return self.tokens[self.cached :]

    def _closed_by(self) -> str:
        """The start of ``close`` that the last answer's end token already wrote."""
        if self.tokens and self.tokens[-1] in self.tokenizer.eos_token_ids:
            end = self.tokenizer.decode([self.tokens[-1]])
            if end and self.close.startswith(end):
                return end
        return ""

    def begin_turn(self, text: str) -> list[int]:
        """The tokens of a user turn: from closing the last answer to the reply's start."""
        if not self.tokens:
            messages = [{"role": "user", "content": text}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:
            rendered = self.close[len(self._closed_by()) :] + self.opening + text + self.reply
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def end_answer(self) -> None:
        """Trim the cache to the committed tokens, which decoding overran.

        Decoding queues the next pass before handing out tokens, so the cache
        may hold drafts or tokens past the stop. Layers are trimmed one by one:
        a second Ctrl-C may have stopped a pass between two layers.
        """
        eos = self.tokenizer.eos_token_ids
        if self.tokens and self.tokens[-1] in eos and not self._closed_by():
            self.tokens.pop()  # an end token the template does not close with (<|endoftext|>)
        keep = min(len(self.tokens), self.cached)
        for c in self.cache:
            if c.offset > keep:
                c.trim(c.offset - keep)

    def summary(self, limit: int) -> str:
        lines = [f"{len(self.turns)} turns, {len(self.tokens)} of {limit} tokens in the context"]
        tokens = passes = 0
        for i, (new, carried, r) in enumerate(self.turns, start=1):
            tokens, passes = tokens + r.stats.tokens, passes + r.stats.steps
            lines.append(f"turn {i}: {_turn_line(new, carried, r)}")
        if passes:
            lines.append(f"all turns: {tokens / passes:.2f} tokens per backbone pass")
        return "\n".join(lines)


def _turn_line(new: int, carried: int, r: Response) -> str:
    return (
        f"prefill {new + carried} tokens ({new} new + {carried} carried over) | "
        f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tokens/s | "
        f"{r.stats.tokens_per_step:.2f} tokens per backbone pass | mode {r.stats.mode}"
    )


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


def mode_problem(config: DecodeConfig, mode: str, model, heads) -> str | None:
    """Why ``mode`` cannot run with these heads, or None."""
    try:
        replace(config, mode=mode).resolve(model, heads)
    except ClpError as e:
        return str(e)
    return None


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
    prompt = conv.unfed + new
    conv.tokens += new
    max_tokens = min(config.max_tokens, room)
    last, interrupted = None, False
    turn = replace(config, max_tokens=max_tokens)
    stream = stream_generate(
        conv.model, conv.tokenizer, prompt, heads, config=turn, prompt_cache=conv.cache
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
        print(f"[{_turn_line(len(new), carried, last)} | context {len(conv.tokens)}/{limit}]")
        if last.finish_reason == "length" and max_tokens < config.max_tokens:
            print("[the context is full: type r to start over]")


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clp_mlx.chat", description=__doc__.split("\n")[0])
    add_model_args(p)
    add_decode_args(p, max_tokens=256)
    p.add_argument("--system-prompt", default=None, help="system message of the conversation")
    p.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="most tokens a conversation may hold (default: the model's context length); "
        "old tokens are never dropped: when full, reset",
    )
    return p


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    # Each answer draws its sampling key from mx.random, seeded once here.
    config = decode_config(args)
    config = replace(config, sampling=replace(config.sampling, seed=None))
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise ClpError(f"--max-kv-size must be at least 2, got {args.max_kv_size}")
    mx.random.seed(args.seed)
    model, tokenizer, heads = load_model(args)
    if tokenizer.chat_template is None:
        raise ClpError("this model has no chat template; use clp_mlx.generate")
    config = replace(config, mode=config.resolve(model, heads).mode)
    limit = args.max_kv_size or model.args.max_position_embeddings
    conv = Conversation(model, tokenizer, args.system_prompt)
    sampling = f"temp {args.temp}, top-p {args.top_p}, top-k {args.top_k}"
    k = heads.k if heads is not None else 0
    print(f"[mode {config.mode}, k={k} | {sampling if args.temp else 'greedy'} | context {limit}]")
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
        word, _, rest = line.partition(" ")
        if line in ("q", "/quit"):
            return 0
        elif line in ("r", "/reset"):
            conv.reset()
            print("[new conversation]")
        elif line in ("h", "/help"):
            print(HELP)
        elif line in ("s", "/stats"):
            print(conv.summary(limit))
        elif word == "/mode":
            mode = rest.strip() or config.mode
            problem = mode_problem(config, mode, model, heads)
            config = config if problem else replace(config, mode=mode)
            print(f"[{problem or f'mode {config.mode}'}]")
        elif line:
            answer(conv, line, config, heads, limit)


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
