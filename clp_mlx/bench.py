"""``python -m clp_mlx.bench``: speed and quality of every mode against ``ar``.

Prompts: the openings of WikiText-2 test articles, as in the paper (the first
paragraph of each of the first N articles, cut to ``--prompt-tokens``), or a
file with one prompt per line. Methods run interleaved, prompt by prompt,
after a warm-up; each figure is the median over prompts of the per-prompt
ratio against ``ar`` on the same prompt, with the spread (min-max) shown.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from .cli import run
from .decode import MODES, DecodeStats, decode
from .errors import ClpError


def wikitext_prompts(path: str, n: int) -> list[str]:
    """First paragraph of each of the first ``n`` articles (' = Title = ' lines)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    prompts, in_article = [], False
    for line in lines:
        s = line.strip()
        if s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
            in_article = True
        elif in_article and s and not s.startswith("="):
            prompts.append(s)
            in_article = False
            if len(prompts) == n:
                break
    if not prompts:
        raise ClpError(f"{path} holds no WikiText articles")
    return prompts


def repetition_ratio(tokens: list[int]) -> float:
    """1 - distinct 3-grams / all 3-grams (the paper's measure)."""
    grams = [tuple(tokens[i : i + 3]) for i in range(len(tokens) - 2)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def run_one(model, heads, ids, mode, max_tokens, k):
    """One generation; mode "verify-clp" is verify feeding only CLP's count."""
    stats = DecodeStats(mode, k if mode != "ar" else 0)
    tic = time.perf_counter()
    feed = "clp" if mode == "verify-clp" else "all"
    kind = "verify" if mode == "verify-clp" else mode
    gen = decode(ids, model, heads, mode=kind, max_tokens=max_tokens, stats=stats, feed=feed)
    first = next(gen)
    t_first = time.perf_counter()
    out = [first[0]] + [t for t, _ in gen]
    done = time.perf_counter()
    return out, stats, (len(out) - 1) / (done - t_first), t_first - tic


def bench(model, tokenizer, heads, prompts, modes, *, max_tokens, prompt_tokens, repeats=1):
    k = heads.k if heads is not None else 0
    encoded = [tokenizer.encode(p)[:prompt_tokens] for p in prompts]
    run_one(model, heads, encoded[0], "ar", 8, k)  # warm-up: compile, caches
    rows = {
        m: {
            "tps": [],
            "ratio": [],
            "tau": [],
            "rep": [],
            "same": [],
            "prefix": [],
            "hist": [0] * (k + 1),
        }
        for m in modes
    }
    for ids in encoded:
        for _ in range(repeats):
            results = {m: run_one(model, heads, ids, m, max_tokens, k) for m in modes}
            ref = results["ar"][0]
            for m, (out, stats, tps, _) in results.items():
                r = rows[m]
                r["tps"].append(tps)
                r["ratio"].append(tps / results["ar"][2])
                r["tau"].append(stats.tokens_per_step)
                r["rep"].append(repetition_ratio(out))
                r["same"].append(out == ref)
                r["prefix"].append(
                    next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(out))
                )
                if stats.k:
                    r["hist"] = [a + b for a, b in zip(r["hist"], stats.accepted)]
    return {
        m: {
            "decode_tps": round(statistics.median(r["tps"]), 3),
            "speedup": round(statistics.median(r["ratio"]), 3),
            "speedup_min": round(min(r["ratio"]), 3),
            "speedup_max": round(max(r["ratio"]), 3),
            "tokens_per_pass": round(statistics.mean(r["tau"]), 3),
            "repetition": round(statistics.mean(r["rep"]), 4),
            "identical_to_ar": round(sum(r["same"]) / len(r["same"]), 3),
            "mean_common_prefix": round(statistics.mean(r["prefix"]), 1),
            "accepted_histogram": r["hist"],
        }
        for m, r in rows.items()
    }


def markdown(table: dict) -> str:
    head = "| mode | speed-up vs ar (min-max) | decode tok/s | τ | repetition | identical to ar |"
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for m, r in table.items():
        lines.append(
            f"| {m} | {r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) "
            f"| {r['decode_tps']:.2f} | {r['tokens_per_pass']:.2f} | {r['repetition']:.4f} "
            f"| {r['identical_to_ar']:.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clp_mlx.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--heads", default=None, help="heads folder or 'init' (default: shipped heads)")
    p.add_argument("--wikitext", help="WikiText-2 raw test file (the paper's prompts)")
    p.add_argument("--prompts", help="a text file, one prompt per line")
    p.add_argument("--num-prompts", type=int, default=15)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", "-m", type=int, default=64)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=[*MODES, "verify-clp"],
        default=["ar", "verify", "clp", "fixed"],
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if bool(args.wikitext) == bool(args.prompts):
        raise ClpError("give exactly one of --wikitext FILE or --prompts FILE")
    source = args.wikitext or args.prompts
    if not Path(source).is_file():
        raise ClpError(f"prompt file {source} does not exist")
    if args.wikitext:
        prompts = wikitext_prompts(args.wikitext, args.num_prompts)
    else:
        prompts = [s for s in Path(args.prompts).read_text().splitlines() if s.strip()][
            : args.num_prompts
        ]
    modes = ["ar"] + [m for m in args.modes if m != "ar"]
    from .api import load

    model, tokenizer, heads = load(args.model, args.heads)
    table = bench(
        model,
        tokenizer,
        heads,
        prompts,
        modes,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        repeats=args.repeats,
    )
    print(markdown(table))
    if args.json:
        import mlx.core as mx

        env = {
            "machine": platform.machine(),
            "system": platform.system(),
            "device": str(mx.default_device()),
        }
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "env": env, "results": table}, indent=1)
        )
    return 0


if __name__ == "__main__":
    run(main)
