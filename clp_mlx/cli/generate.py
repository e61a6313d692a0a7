"""``python -m clp_mlx.generate``: generate text from the command line.

Flags follow mlx_lm.generate 0.32 (names, meanings, defaults: the chat
template is on where the tokenizer has one, ``--verbose`` is True); text
streams as it is generated. ``--draft-model`` runs mlx-lm's own speculative
decoding instead of clp-mlx's drafter, for comparison. mlx-lm's flags that
clp-mlx cannot honour are refused with one error line; see docs/FLAGS.md.
"""

from __future__ import annotations

import argparse
import sys

from ..api import print_stats, stream_generate
from ..errors import ClpError
from ..model.backbone import token_count
from . import draft_model
from .args import (
    add_decode_args,
    add_model_args,
    decode_config,
    load_model,
    no_drafter_note,
    parser,
    run,
)
from .mlx_lm_flags import (
    add_max_kv_size,
    add_prefill_step_size,
    add_refused,
    add_verbose,
    check_max_kv_size,
    check_prefill_step_size,
    kv_limit,
    prefill_step_size,
    refuse_unsupported,
)
from .prompt import add_prompt_args, add_stop_tokens, prompt_ids, template_config


def setup_arg_parser() -> argparse.ArgumentParser:
    p = parser(
        "python -m clp_mlx.generate",
        "Generate text with Backbone-as-Architect multi-token decoding.",
    )
    add_model_args(p)
    add_prompt_args(p)
    add_decode_args(p, max_tokens=100, seed=None)
    add_verbose(p)
    add_max_kv_size(p, "a prompt that does not fit with --max-tokens is refused")
    add_prefill_step_size(p)
    draft_model.add_draft_model_args(p)
    add_refused(p, "generate")
    return p


def main(argv=None) -> int:
    p = setup_arg_parser()
    args = p.parse_args(argv)
    refuse_unsupported(args)
    config = decode_config(args)
    template_kwargs = template_config(args.chat_template_config)
    check_max_kv_size(args.max_kv_size)
    check_prefill_step_size(args.prefill_step_size)
    if args.draft_model is not None:
        n_draft = draft_model.check_flags(args, p)
        model, tokenizer, draft = draft_model.load_pair(args)
        heads = note = None  # mlx-lm's decoding: no drafter
    else:
        model, tokenizer, heads, resolved = load_model(args, config)
        note = no_drafter_note(args, heads, resolved) if args.verbose else None
    add_stop_tokens(tokenizer, args.extra_eos_token, token_count(model))
    ids = prompt_ids(args, tokenizer, template_kwargs)
    fits(args, model, len(ids))
    with prefill_step_size(args.prefill_step_size):
        if args.draft_model is not None:
            responses = draft_model.stream(args, model, tokenizer, draft, ids, n_draft)
        else:
            responses = stream_generate(model, tokenizer, ids, heads, config=config)
        last, drafted = None, 0
        for last in responses:
            if note is not None:  # once decoding has begun: a bad prompt gets its error line alone
                print(note, file=sys.stderr)
                note = None
            if args.verbose and last.generation_tokens == 1:
                print("=" * 10)  # as mlx-lm, before and after the text
            drafted += bool(last.from_draft) and last.finish_reason != "stop"
            print(last.text, end="", flush=True)
    print()
    if args.verbose and last is not None:
        if args.draft_model is not None:
            draft_model.print_stats(last, drafted)
        else:
            print_stats(last)
    return 0


def fits(args: argparse.Namespace, model, n_prompt: int) -> None:
    """--max-kv-size: the prompt and --max-tokens must fit (no token is ever dropped)."""
    if args.max_kv_size is None:
        return
    limit = kv_limit(args.max_kv_size, model)
    if n_prompt + args.max_tokens > limit:
        raise ClpError(
            f"the prompt's {n_prompt} tokens and --max-tokens {args.max_tokens} do not fit in "
            f"--max-kv-size {limit} (clp-mlx never drops cached tokens): raise it or lower "
            "--max-tokens"
        )


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
