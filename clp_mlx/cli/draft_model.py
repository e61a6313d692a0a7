"""generate's ``--draft-model``: mlx-lm's own speculative decoding (a small
model drafts ``--num-draft-tokens`` tokens, the big one checks them), run by
``mlx_lm.generate.stream_generate``, so that it and clp-mlx's drafter can be
compared in one tool."""

from __future__ import annotations

import argparse

import mlx.core as mx

from ..errors import ClpError

MLX_LM_DRAFT_TOKENS = 3  # mlx-lm's default --num-draft-tokens
# clp-mlx's decode flags, which mean nothing to mlx-lm's speculative decoding.
OURS_ONLY = {
    "heads": "--drafter",
    "mode": "--mode",
    "draft_len": "--draft-len",
    "verify_feed": "--verify-feed",
    "context_drafts": "--context-drafts",
    "tree": "--tree",
    "clp_threshold": "--clp-threshold",
}


def add_draft_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-model", default=None, metavar="MODEL",
        help="run mlx-lm's speculative decoding instead of clp-mlx's, with this smaller "
        "model (same tokenizer) drafting, to compare the two",
    )  # fmt: skip
    p.add_argument(
        "--num-draft-tokens", type=int, default=None, metavar="N",
        help=f"tokens the --draft-model drafts per step (default: {MLX_LM_DRAFT_TOKENS}, as "
        "mlx-lm); without --draft-model the same as --draft-len",
    )  # fmt: skip


def check_flags(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """--num-draft-tokens for --draft-model; a clp-mlx-only decode flag is refused."""
    for dest, flag in OURS_ONLY.items():
        if getattr(args, dest) != p.get_default(dest):
            raise ClpError(
                f"{flag} is for clp-mlx's own decoding; --draft-model runs mlx-lm's "
                "speculative decoding (drop one of them)"
            )
    n = MLX_LM_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens
    if n < 1:
        raise ClpError(f"--num-draft-tokens must be at least 1, got {n}")
    return n


def load_pair(args: argparse.Namespace):
    """(model, tokenizer, draft model), as mlx-lm loads them: no drafter."""
    from ..api import load_with_drafter as load

    model, tokenizer, _ = load(args.model, "none", dtype=args.dtype)
    draft, draft_tokenizer, _ = load(args.draft_model, "none", dtype=args.dtype)
    if draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ClpError(
            f"--draft-model {args.draft_model}: its tokenizer ({draft_tokenizer.vocab_size} "
            f"tokens) does not match the model's ({tokenizer.vocab_size})"
        )
    return model, tokenizer, draft


def stream(args: argparse.Namespace, model, tokenizer, draft, ids: list[int], n: int):
    """mlx-lm's responses, sampled as mlx_lm.generate samples (seeded by --seed if given)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, args.min_tokens_to_keep, top_k=args.top_k)
    return stream_generate(
        model,
        tokenizer,
        mx.array(ids),
        max_tokens=args.max_tokens,
        draft_model=draft,
        num_draft_tokens=n,
        sampler=sampler,
        prefill_step_size=args.prefill_step_size,
    )


def print_stats(last, drafted: int) -> None:
    """mlx-lm's statistics block, and how many tokens came from the draft model."""
    print("=" * 10)
    print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
    print(f"Draft model: {drafted} of {last.generation_tokens} tokens accepted from its drafts")
    print(f"Peak memory: {last.peak_memory:.3f} GB")
