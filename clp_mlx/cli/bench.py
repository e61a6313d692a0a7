"""``python -m clp_mlx.bench``: speed and quality of every method against ``ar``.

Methods: our decode modes (``ar``, ``clp``, ``fixed``, ``gate``,
``prior-mtp``, ``verify`` as generate runs it; variants in
:mod:`clp_mlx.bench_methods`) and two peers from mlx-lm, ``mlx-lm`` (its greedy
``generate_step``) and ``mlx-lm-draft`` (its ``speculative_generate_step``
with ``--draft-model`` drafting ``--draft-tokens`` tokens). All decode
greedily from the same prompt ids; methods run interleaved, prompt by prompt,
after one warm-up run of each.

Prompts: ``--wikitext FILE``, the paper's (the first paragraph of each of the
first N WikiText-2 test articles, cut to ``--prompt-tokens``), or ``--prompts
FILE [FILE ...]``, instructions kept whole (JSONL with "prompt" or MT-Bench
"turns", first turn; or one prompt per line), file after file.

Chat template rule (``--chat-template``, default ``auto``): instruction
prompts from ``--prompts`` are wrapped in the tokenizer's chat template (a
user turn plus the generation prompt) when the tokenizer has one; WikiText
openings never are. ``always`` wraps both (an error if the tokenizer has no
template), ``never`` neither.

Each prompt is prefilled once (timed: ``prefill_s``) and every method decodes
from that cache. Per method: decode tok/s from the first token on and the time
to the first token after the prefill, medians; speed-up = median over prompts of the per-prompt ratio
to ``ar`` on the same prompt, with its min-max; tokens per backbone pass and
the accepted-draft histogram; repetition; share of outputs identical to
``ar`` and mean common prefix with it; perplexity of the output under the
backbone (a teacher-forced pass after timing); peak memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ..bench.measures import peak_memory_source, repetition_ratio
from ..bench.methods import DEFAULT_MODES, METHODS, method_config, needs_heads
from ..bench.run import bench
from ..bench.prompts import (
    CHAT_TEMPLATE_CHOICES,
    bench_texts,
    encode_prompts,
    wikitext_prompts,
)
from ..bench.report import environment, markdown, plots, weights_dtype, write_json
from ..errors import ClpError
from .args import parser, run

__all__ = ["bench", "main", "repetition_ratio", "settings", "wikitext_prompts"]

DEFAULTS = {"num_prompts": 15, "max_tokens": 64, "modes": list(DEFAULT_MODES), "repeats": 1}
QUICK = {"num_prompts": 3, "max_tokens": 32, "modes": ["ar", "verify", "clp"], "repeats": 1}


# -- command line ---------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = parser("python -m clp_mlx.bench", __doc__.splitlines()[0])
    p.add_argument(
        "--model", nargs="+", default=[None], help="one or more models (default: the 0.5B)"
    )
    p.add_argument(
        "--heads",
        default=None,
        help="heads folder (one model only), 'init', or 'none': context drafts only "
        "(default: heads made for each model's weights, if any)",
    )
    p.add_argument("--draft-model", help="mlx-lm-draft's draft model, for every bigger model")
    p.add_argument("--draft-tokens", type=int, default=3, help="mlx-lm-draft's drafts per pass")
    p.add_argument("--wikitext", help="WikiText-2 raw test file (the paper's prompts)")
    p.add_argument("--prompts", nargs="+", metavar="FILE",
                   help="instructions: JSONL (prompt / turns) or one per line; "
                   "several files: their prompts one file after another")  # fmt: skip
    p.add_argument("--chat-template", default="auto", help="auto (default), always or never")
    p.add_argument("--num-prompts", type=int, help="default 15 (--quick: 3)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="cut WikiText prompts to this")
    p.add_argument("--max-tokens", "-m", type=int, help="new tokens, default 64 (--quick: 32)")
    p.add_argument(
        "--modes",
        nargs="+",
        help=f"of {', '.join(METHODS)} (default: {' '.join(DEFAULT_MODES)}); -heads: without "
        "context drafts; clp@Q: CLP accepts the longest n with P(run >= n) >= Q",
    )
    p.add_argument("--repeats", type=int, help="runs per prompt and method (default 1)")
    p.add_argument("--quick", action="store_true", help="3 prompts, 32 tokens, ar verify clp")
    p.add_argument("--json", help="write every number and the environment here")
    p.add_argument("--plots", help="folder for speedup-vs-quality.png and accepted-lengths.png")
    return p


def settings(argv=None) -> argparse.Namespace:
    """Parsed and checked options; --quick changes the defaults, explicit options win."""
    args = _parser().parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for method in args.modes:
        method_config(method)  # a clear error for an unknown one
    args.modes = ["ar", *(m for m in dict.fromkeys(args.modes) if m != "ar")]
    for name, least in (("repeats", 1), ("max_tokens", 2), ("num_prompts", 1)):
        if getattr(args, name) < least:
            why = " (the first token is the prefill)" if name == "max_tokens" else ""
            raise ClpError(f"--{name.replace('_', '-')} must be at least {least}{why}")
    for name in ("prompt_tokens", "draft_tokens"):
        if getattr(args, name) < 1:
            raise ClpError(f"--{name.replace('_', '-')} must be at least 1")
    if args.chat_template not in CHAT_TEMPLATE_CHOICES:
        raise ClpError(f"--chat-template must be one of {', '.join(CHAT_TEMPLATE_CHOICES)}")
    if bool(args.wikitext) == bool(args.prompts):
        raise ClpError("give exactly one of --wikitext FILE or --prompts FILE [FILE ...]")
    if "mlx-lm-draft" in args.modes and not args.draft_model:
        raise ClpError("mode mlx-lm-draft needs --draft-model (a smaller model, same tokenizer)")
    if len(args.model) > 1 and args.heads not in (None, "init", "none"):
        raise ClpError("--heads FOLDER fits one model; with several, each uses its shipped heads")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise ClpError(f"--json: the folder of {args.json} does not exist")
    if args.plots and Path(args.plots).exists() and not Path(args.plots).is_dir():
        raise ClpError(f"--plots: {args.plots} is a file, not a folder")
    return args


def _size(model) -> int:
    """A proxy for the parameter count that ignores quantization."""
    a = model.args
    return a.num_hidden_layers * a.hidden_size * (a.hidden_size + a.intermediate_size)


def _methods_for(args, spec, model, heads, draft) -> tuple[list, list]:
    """The methods this model runs, and notes on those it skips."""
    skipped, notes = [], []
    if heads is None:
        skipped = [m for m in args.modes if needs_heads(m)]
    if skipped and len(args.model) == 1:
        raise ClpError(
            f"mode {skipped[0]} needs heads and none were made for this model: "
            "pass --heads FOLDER or --heads init"
        )
    if skipped:
        notes.append(f"skipped {', '.join(skipped)}: no heads were made for {spec}")
    if draft is not None and (spec == args.draft_model or _size(model) <= _size(draft)):
        why = "is the draft model" if spec == args.draft_model else "is not bigger than the draft"
        notes.append(f"skipped mlx-lm-draft: {spec} {why}")
        skipped.append("mlx-lm-draft")
    return [m for m in args.modes if m not in skipped], notes


def _one_model(args, spec, texts, kind, draft) -> dict:
    """Benchmark one model, print its table; its entry of the JSON."""
    from ..api import load_with_drafter as load
    from ..model.heads_files import find_heads
    from ..sources.resolve import default_model_name

    model, tokenizer, heads = load(spec, args.heads)
    ids, templated = encode_prompts(
        tokenizer, texts, kind, chat_template=args.chat_template, prompt_tokens=args.prompt_tokens
    )
    methods, notes = _methods_for(args, spec, model, heads, draft)
    table = bench(
        model,
        heads,
        ids,
        methods,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        draft=draft,
        draft_tokens=args.draft_tokens,
    )
    name = spec or default_model_name()
    print(f"## {name}\n\n{markdown(table)}\n")
    for note in notes:
        print(f"note: {note}\n")
    return {
        "model": name,
        "weights_dtype": weights_dtype(model),
        "heads": None if heads is None else str(args.heads or find_heads(model)),
        "k": heads.k if heads is not None else 0,
        "chat_template": templated,
        "mean_prompt_tokens": round(statistics.mean(len(x) for x in ids), 1),
        "draft_model": args.draft_model if "mlx-lm-draft" in methods else None,
        "notes": notes,
        "results": table,
    }


def main(argv=None) -> int:
    args = settings(argv)
    texts, kind = bench_texts(args.wikitext, args.prompts, args.num_prompts)
    source = args.wikitext or ", ".join(args.prompts)
    import mlx.core as mx

    from ..api import load_with_drafter as load

    draft = load(args.draft_model, None)[0] if "mlx-lm-draft" in args.modes else None
    entries = []
    for spec in args.model:
        entries.append(_one_model(args, spec, texts, kind, draft))
        mx.clear_cache()  # the model is gone: return its buffers before the next loads
    if args.json:
        env = {**environment(), "peak_memory": peak_memory_source()}
        prompts = {"file": source, "kind": kind, "count": len(texts)}
        report = {"args": vars(args), "env": env, "prompts": prompts, "models": entries}
        write_json(args.json, report)
    if args.plots:
        for path in plots(entries, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
