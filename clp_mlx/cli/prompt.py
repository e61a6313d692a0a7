"""generate's prompt, built as ``mlx_lm.generate`` builds it: ``\\n`` and
``\\t`` in ``-p`` made a newline and a tab, then the model's chat template
(on unless ``--ignore-chat-template`` or the tokenizer has none), with
``--system-prompt``, ``--prefill-response`` and ``--chat-template-config``;
and the stop tokens ``--extra-eos-token`` adds.

Where mlx-lm silently drops a flag (``--system-prompt`` on a model without a
template), clp-mlx says so in one error line.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ClpError
from ..model.tokens import check_text, encode

DEFAULT_PROMPT = "hello"  # mlx-lm's
# Set from the other flags: the JSON may not set them.
_SET_HERE = ("tokenize", "add_generation_prompt", "continue_final_message", "conversation")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt", "-p", default=DEFAULT_PROMPT,
        help="the prompt; '-' reads standard input; \\n and \\t in it become a newline and "
        f"a tab (default: {DEFAULT_PROMPT}, as mlx-lm)",
    )  # fmt: skip
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument(
        "--prefill-response", default=None, metavar="TEXT",
        help="start of the answer: the template's assistant message, continued",
    )  # fmt: skip
    p.add_argument(
        "--ignore-chat-template", action="store_true",
        help="use the raw prompt, without the tokenizer's chat template (on by default "
        "where the tokenizer has one, as mlx-lm)",
    )  # fmt: skip
    # clp-mlx's old switch: the template is now on by default.
    p.add_argument("--chat-template", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--use-default-chat-template", action="store_true",
        help="for a tokenizer without a chat template, use its default template (older "
        "transformers had one; an error where there is none)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template-config", default=None, metavar="JSON",
        help='extra arguments for the chat template, as a JSON object (e.g. \'{"enable_thinking": false}\')',
    )  # fmt: skip
    p.add_argument(
        "--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
        help="more tokens that end the generation (a token or its id)",
    )  # fmt: skip


def template_config(text: str | None) -> dict:
    """The keyword arguments --chat-template-config gives (checked before a model loads)."""
    if text is None:
        return {}
    check_text(text, "--chat-template-config")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClpError(f"--chat-template-config is not valid JSON ({e.msg}, at character {e.pos})") from None
    if not isinstance(config, dict):
        raise ClpError(f"--chat-template-config must be a JSON object, not {type(config).__name__}")
    taken = sorted(set(config) & set(_SET_HERE))
    if taken:
        raise ClpError(f"--chat-template-config cannot set {', '.join(taken)}: clp-mlx sets it")
    return config


def read_stdin() -> str:
    if sys.stdin is None:
        raise ClpError("--prompt -: there is no standard input to read")
    if not hasattr(sys.stdin, "buffer"):  # a text stream put in its place
        return check_text(sys.stdin.read(), "standard input")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ClpError(f"standard input is not UTF-8 text (byte {e.start}): pass UTF-8") from None


def has_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None or bool(
        getattr(tokenizer, "has_chat_template", False)
    )


def use_default_template(tokenizer) -> None:
    """--use-default-chat-template: as mlx-lm's server does it."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return
    default = getattr(tokenizer, "default_chat_template", None)
    if default is None:
        raise ClpError(
            "--use-default-chat-template: this tokenizer has no default chat template "
            "(transformers 4.43 and later give none)"
        )
    tokenizer.chat_template = default


def prompt_ids(args: argparse.Namespace, tokenizer, template_kwargs: dict) -> list[int]:
    """The prompt's token ids, as mlx_lm.generate's main makes them."""
    prompt = check_text(args.prompt).replace("\\n", "\n").replace("\\t", "\t")
    prompt = read_stdin() if prompt == "-" else prompt
    for flag in ("system_prompt", "prefill_response"):
        if getattr(args, flag) is not None:
            check_text(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.use_default_chat_template:
        use_default_template(tokenizer)
    if args.ignore_chat_template or not has_template(tokenizer):
        _no_template(args, tokenizer)
        if not prompt:
            raise ClpError("the prompt is empty: pass --prompt/-p TEXT (or '-' to read stdin)")
        return encode(tokenizer, prompt)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    prefill = args.prefill_response is not None
    if prefill:
        messages.append({"role": "assistant", "content": args.prefill_response})
    text = render(tokenizer, messages, prefill, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def render(tokenizer, messages, prefill: bool, template_kwargs: dict) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=prefill,
            add_generation_prompt=not prefill,
            **template_kwargs,
        )
    except (TemplateError, ValueError, TypeError) as e:
        raise ClpError(f"the chat template cannot render this prompt: {e}") from e


def _no_template(args: argparse.Namespace, tokenizer) -> None:
    """An error for the flags that need the chat template when it is off."""
    given = [
        flag
        for flag, value in (
            ("--system-prompt", args.system_prompt),
            ("--prefill-response", args.prefill_response),
            ("--chat-template-config", args.chat_template_config),
        )
        if value is not None
    ]
    if not given:
        return
    why = "--ignore-chat-template turns it off" if args.ignore_chat_template else "this model has none"
    raise ClpError(f"{given[0]} needs the chat template, and {why}")


def add_stop_tokens(tokenizer, tokens, vocab: int) -> None:
    """--extra-eos-token: each (a token, or an id) ends the generation too,
    as mlx-lm's ``tokenizer.add_eos_token``; one that is no token is refused."""
    for token in tokens:
        check_text(token, "--extra-eos-token")
        try:
            tid = int(token)
        except ValueError:
            tid = tokenizer.convert_tokens_to_ids(token)
            unk = getattr(tokenizer, "unk_token", None)
            if tid is not None and unk is not None and token != unk and tid == tokenizer.unk_token_id:
                tid = None
        if tid is None or not 0 <= tid < vocab:
            raise ClpError(f"--extra-eos-token {token!r} is not a token of this model")
        if hasattr(tokenizer, "add_eos_token"):
            tokenizer.add_eos_token(str(tid))
        else:
            tokenizer.eos_token_ids.add(tid)
