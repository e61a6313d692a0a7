"""``python -m clp_mlx.generate``: generate text from the command line.

Flags follow mlx_lm.generate; text streams as it is generated.
"""

from __future__ import annotations

import argparse
import sys

from ..api import print_stats, stream_generate
from ..errors import ClpError
from ..model.tokens import check_text
from .args import (
    add_decode_args,
    add_model_args,
    decode_config,
    load_model,
    no_drafter_note,
    parser,
    run,
)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = parser(
        "python -m clp_mlx.generate",
        "Generate text with Backbone-as-Architect multi-token decoding.",
    )
    add_model_args(p)
    p.add_argument("--prompt", "-p", default=None, help="the prompt; '-' reads standard input")
    add_decode_args(p, max_tokens=100)
    p.add_argument("--system-prompt", default=None, help="system message; implies --chat-template")
    p.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap the prompt in the model's chat template (default: plain continuation)",
    )
    p.add_argument("--verbose", action="store_true", help="print statistics after the text")
    return p


def _read_stdin() -> str:
    if sys.stdin is None:
        raise ClpError("--prompt -: there is no standard input to read")
    if not hasattr(sys.stdin, "buffer"):  # a text stream put in its place
        return check_text(sys.stdin.read(), "standard input")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClpError(f"standard input is not UTF-8 text (byte {e.start}): pass UTF-8") from None


def _prompt_text(args, tokenizer):
    prompt = _read_stdin() if args.prompt == "-" else check_text(args.prompt)
    if not prompt:
        raise ClpError("the prompt is empty: pass --prompt/-p TEXT (or '-' to read stdin)")
    if args.system_prompt is not None:
        check_text(args.system_prompt, "--system-prompt")
    if not (args.chat_template or args.system_prompt):
        return prompt
    if tokenizer.chat_template is None:
        raise ClpError("this model has no chat template; drop --chat-template/--system-prompt")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    config = decode_config(args)
    if args.prompt is None:
        raise ClpError("no prompt: pass --prompt/-p TEXT (or '-' to read stdin)")
    model, tokenizer, heads, resolved = load_model(args, config)
    prompt = _prompt_text(args, tokenizer)
    note = no_drafter_note(args, heads, resolved)
    last = None
    for last in stream_generate(model, tokenizer, prompt, heads, config=config):
        if note:  # once decoding has begun: a bad prompt gets its error line alone
            print(note, file=sys.stderr)
            note = None
        print(last.text, end="", flush=True)
    print()
    if args.verbose and last is not None:
        print_stats(last)
    return 0


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
