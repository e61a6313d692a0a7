"""Verify's speed with two or more drafters, against plain decoding, in one process.

    python examples/compare_drafters.py --model MODEL --drafters A B [...] \\
        (--wikitext wiki.test.raw | --prompts FILE [FILE ...]) [-n 14] [-m 64] [--rounds 2]

Every prompt runs ``ar`` and greedy verify with each drafter (a drafter
folder, or ``shipped``: the one made for the model), interleaved, the order
reversed every other round. Outputs must all be identical. Prints each
drafter's speed-up over ``ar`` (median of the rounds per prompt; in all, and
the median and range over prompts), its tokens per pass, and per prompt how
the last drafter's time compares with the first's.
"""

import argparse
import statistics as st
import sys
import time

import clp_mlx  # noqa: F401  (loads OpenBLAS before MLX)
import mlx.core as mx

from clp_mlx import api
from clp_mlx.bench.prompts import encode_prompts, instruction_prompts, wikitext_prompts
from clp_mlx.decode.loop import decode
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import find_heads, load_heads

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", required=True)
p.add_argument("--drafters", nargs="+", required=True)
where = p.add_mutually_exclusive_group(required=True)
where.add_argument("--wikitext")
where.add_argument("--prompts", nargs="+")
p.add_argument("-n", type=int, default=14, help="prompts (default 14)")
p.add_argument("-m", type=int, default=64, help="new tokens (default 64)")
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()
if min(args.n, args.m, args.rounds) < 1:
    sys.exit("compare_drafters.py: -n, -m and --rounds must be 1 or more")
try:
    model, tokenizer, _ = api.load_with_drafter(args.model, "none")
    shipped = find_heads(model)
    names = [shipped if d == "shipped" else d for d in args.drafters]
    if None in names:
        raise ClpError(f"no drafter is made for {args.model}: name a folder")
    drafters = {d: load_heads(n, model) for d, n in zip(args.drafters, names)}
    if args.wikitext:
        texts, kind = wikitext_prompts(args.wikitext, args.n), "wikitext"
    else:
        texts = [t for f in args.prompts for t in instruction_prompts(f)][: args.n]
        kind = "instruction"
    prompts, _ = encode_prompts(tokenizer, texts, kind)
except ClpError as e:
    sys.exit(f"compare_drafters.py: {e}")


def run(prompt, drafter):
    config = api.decode_config(mode="ar" if drafter is None else "verify", max_tokens=args.m)
    tic = time.perf_counter()
    steps = list(decode(mx.array(prompt), model, drafters.get(drafter), config))
    return time.perf_counter() - tic, [t for s in steps for t in s.tokens], len(steps)


ways = [None, *drafters]
for way in ways:
    run(prompts[0], way)  # warm
times = {w: [[] for _ in prompts] for w in ways}
passes = {w: [0] * len(prompts) for w in ways}
for r in range(args.rounds):
    for i, prompt in enumerate(prompts):
        out = {}
        for way in ways[:: -1 if r % 2 else 1]:
            seconds, tokens, passes[way][i] = run(prompt, way)
            times[way][i].append(seconds)
            out[way] = tokens
        assert all(t == out[None] for t in out.values()), f"prompt {i}: outputs differ"
med = {w: [st.median(t) for t in times[w]] for w in ways}
tokens = args.m * len(prompts)
print(f"ar: {tokens / sum(med[None]):.2f} tokens/s, {len(prompts)} prompts, {args.rounds} rounds")
for way in drafters:
    per = [a / b for a, b in zip(med[None], med[way])]
    print(f"{way}: {sum(med[None]) / sum(med[way]):.3f}x in all; per prompt median "
          f"{st.median(per):.3f}x ({min(per):.2f}-{max(per):.2f}); "
          f"{tokens / sum(passes[way]):.2f} tokens a pass")  # fmt: skip
first, last = args.drafters[0], args.drafters[-1]
per = [a / b for a, b in zip(med[first], med[last])]
faster = sum(x > 1 for x in per)
print(f"{last} over {first}, per prompt: median {st.median(per):.3f} "
      f"({min(per):.3f}-{max(per):.3f}), faster on {faster} of {len(per)}")  # fmt: skip
