"""What generation hands out: one :class:`Response` per token, in mlx-lm's
``GenerationResponse`` shape plus clp-mlx's statistics; mlx-lm's own
generation wrapped in it; and the statistics block ``--verbose`` prints."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from .decode.steps import DecodeStats
from .errors import ClpError


@dataclass
class Response:
    """One streamed token, as mlx-lm's ``GenerationResponse`` plus draft facts."""

    text: str
    token: int
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None
    stats: DecodeStats
    # the backbone's log-probabilities over the vocabulary where this token
    # was chosen (lazy: computed if read), as mlx-lm's; None where
    # the unchecked modes (clp, fixed, gate, prior-mtp) give none
    logprobs: mx.array | None = None


def response(text, token, from_draft, n_prompt, prompt_tps, n, tic, reason, stats, logprobs):
    elapsed = time.perf_counter() - tic
    return Response(
        text=text,
        token=token,
        from_draft=from_draft,
        prompt_tokens=n_prompt,
        prompt_tps=prompt_tps,
        generation_tokens=n,
        generation_tps=n / elapsed if elapsed > 0 else 0.0,
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=reason,
        stats=stats,
        logprobs=logprobs,
    )


def mlx_lm_stream(model, tokenizer, prompt, options, **kwargs):
    """mlx-lm's own generation, as :class:`Response` s (statistics: mode "mlx-lm")."""
    from mlx_lm.generate import stream_generate as mlx_lm_stream

    options = dict(options)
    if kwargs.get("draft_model") is not None and "num_draft_tokens" in options:
        kwargs["num_draft_tokens"] = options.pop("num_draft_tokens")  # mlx-lm's meaning here
    unknown = sorted(set(options) - {"max_tokens"})
    if unknown:
        raise ClpError(
            f"{', '.join(unknown)}: clp-mlx's options, not with mlx-lm's samplers, "
            "logits_processors or draft_model (use clp_mlx.sample_utils.make_sampler)"
        )
    stats = DecodeStats("mlx-lm", 0)
    for r in mlx_lm_stream(model, tokenizer, prompt, options.get("max_tokens", 256), **kwargs):
        stats.steps, stats.tokens = r.generation_tokens, r.generation_tokens
        yield Response(
            text=r.text, token=r.token, from_draft=r.from_draft, prompt_tokens=r.prompt_tokens,
            prompt_tps=r.prompt_tps, generation_tokens=r.generation_tokens,
            generation_tps=r.generation_tps, peak_memory=r.peak_memory,
            finish_reason=r.finish_reason, stats=stats, logprobs=r.logprobs,
        )  # fmt: skip


def print_stats(r: Response) -> None:
    s = r.stats
    print("=" * 10)
    print(f"Prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec")
    print(f"Mode: {s.mode}, k={s.k}, steps: {s.steps}, tokens per step: {s.tokens_per_step:.3f}")
    if s.k:
        print(
            "Accepted drafts per step: " + ", ".join(f"{i}: {c}" for i, c in enumerate(s.accepted))
        )
    print(f"Peak memory: {r.peak_memory:.3f} GB")
