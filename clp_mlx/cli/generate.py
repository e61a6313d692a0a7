"""``python -m clp_mlx.generate``: generate text from the command line.

Flags follow mlx_lm.generate; text streams as it is generated.
"""

from __future__ import annotations

import argparse
import sys

from ..model import backbone
from ..api import load, print_stats, stream_generate
from .args import run
from ..decode.loop import FEEDS, MODES
from ..errors import ClpError
from ..decode.sampling import Sampling


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m clp_mlx.generate",
        description="Generate text with Backbone-as-Architect multi-token decoding.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="named model, MLX/HF folder, .gguf file or Hub repo (default: qwen2.5-coder-0.5b-instruct)",
    )
    p.add_argument(
        "--heads",
        default=None,
        help="heads folder, or 'init' for untrained heads (default: the heads shipped with the model, if any)",
    )
    p.add_argument("--prompt", "-p", default=None, help="the prompt; '-' reads standard input")
    p.add_argument("--max-tokens", "-m", type=int, default=100)
    p.add_argument(
        "--mode", choices=MODES, default=None, help="default: verify with heads, ar without"
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="drafts per step (default: all the heads' k)",
    )
    p.add_argument(
        "--verify-feed",
        choices=FEEDS,
        default="cost",
        help="verify: feed the count of drafts with the most expected tokens per pass time "
        "(cost, default; pass times measured once per setup), as many as CLP expects to be "
        "accepted (clp), or every draft (all)",
    )
    p.add_argument(
        "--context-drafts",
        choices=("auto", "on", "off"),
        default="auto",
        help="copy drafts from the context where it has a match (auto: in verify, not in clp)",
    )
    p.add_argument(
        "--clp-threshold",
        type=float,
        default=None,
        help="clp: accept the longest n whose P(run >= n) reaches this (default: CLP's most "
        "likely run, the paper's rule)",
    )
    p.add_argument(
        "--tree",
        type=int,
        default=None,
        help="verify: a step that feeds 2+ drafts feeds a token tree of up to this many "
        "tokens, alternatives included (default: 16 where wide passes are padded, on "
        "OpenBLAS; else 0, a chain)",
    )
    add_sampling_args(p)
    p.add_argument("--system-prompt", default=None, help="system message; implies --chat-template")
    p.add_argument(
        "--chat-template",
        action="store_true",
        help="wrap the prompt in the model's chat template (default: plain continuation)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(backbone.DTYPES),
        default=None,
        help="default: float32 on CPU, float16 on GPU",
    )
    p.add_argument("--verbose", action="store_true", help="print statistics after the text")
    return p


def check_decode_args(args: argparse.Namespace) -> None:
    """Bad sampling, --max-tokens or --num-draft-tokens fail before the model loads."""
    Sampling(args.temp, args.top_p, args.top_k)
    if args.max_tokens < 1:
        raise ClpError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 1:
        raise ClpError(f"--num-draft-tokens must be at least 1, got {args.num_draft_tokens}")
    q = getattr(args, "clp_threshold", None)
    if q is not None and not 0 < q <= 1:
        raise ClpError(f"--clp-threshold must be in (0, 1], got {q}")


def load_from_args(args: argparse.Namespace):
    """Model, tokenizer and heads as --model, --heads, --dtype, --num-draft-tokens
    and --seed ask (shared with the chat)."""
    return load(
        args.model,
        args.heads,
        dtype=args.dtype,
        num_draft_tokens=args.num_draft_tokens,
        seed=args.seed,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--temp, --top-p, --top-k, --seed: shared with the chat."""
    p.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: 0). verify mode samples exactly "
        "from the backbone's distribution",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens (default: 0, all)"
    )
    p.add_argument("--seed", type=int, default=0, help="PRNG seed, for sampling and --heads init")


def _prompt_tokens(args, tokenizer):
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise ClpError("the prompt is empty: pass --prompt/-p TEXT (or '-' to read stdin)")
    if not (args.chat_template or args.system_prompt):
        return prompt
    if tokenizer.chat_template is None:
        raise ClpError("this model has no chat template; drop --chat-template/--system-prompt")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def main(argv=None) -> int:
    args = setup_arg_parser().parse_args(argv)
    check_decode_args(args)
    if args.prompt is None:
        raise ClpError("no prompt: pass --prompt/-p TEXT (or '-' to read stdin)")
    model, tokenizer, heads = load_from_args(args)
    prompt = _prompt_tokens(args, tokenizer)
    last = None
    for last in stream_generate(
        model,
        tokenizer,
        prompt,
        heads,
        mode=args.mode,
        max_tokens=args.max_tokens,
        num_draft_tokens=args.num_draft_tokens,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        feed=args.verify_feed,
        lookup={"auto": None, "on": True, "off": False}[args.context_drafts],
        clp_threshold=args.clp_threshold,
        tree=args.tree,
    ):
        print(last.text, end="", flush=True)
    print()
    if args.verbose and last is not None:
        print_stats(last)
    return 0


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
