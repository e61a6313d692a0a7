"""Verify's speed with one or more drafters, against plain decoding, in one process.

    python examples/compare_drafters.py --model MODEL --drafters A [B ...] \\
        (--wikitext wiki.test.raw | --prompts FILE [FILE ...]) [-n 14] [-m 64] [--rounds 2] \\
        [--every-depth] [--no-copies] [--every-match] [--feed all|clp|cost] [--per-prompt]

Every prompt runs ``ar`` and greedy verify with each drafter (a drafter
folder, or ``shipped``: the one made for the model), interleaved, the order
reversed every other round. Outputs must all be identical. Prints each
drafter's speed-up over ``ar`` (median of the rounds per prompt; in all, and
the median and range over prompts), its tokens per pass, and per prompt how
the last drafter's time compares with the first's. ``--every-depth`` also
runs each drafter drafting every depth of its layer, without the depth rule
(decode/feed.py: deeper_cannot_pay): the passes must be the same, and it
prints how the rule's time compares and how often it stopped at each depth.
``--no-copies`` also runs each drafter without context copies (``lookup``
off): the MTP layer, or its copy head, drafts where the context repeats;
``--every-match`` also runs each with copies from every match, even beside a
copy head (decode/choose.py: COPY_HEAD_SHORTEST).
``--feed all`` feeds every draft (tokens a pass then measure the drafter
alone, not the cost rule's choice); ``--per-prompt`` prints each prompt's
tokens a pass for every drafter (free of this run's timing noise: the cost
rule reads pass costs measured once per setup and stored).
"""

import argparse
import statistics as st
import sys
import time
from collections import Counter

import clp_mlx  # noqa: F401  (loads OpenBLAS before MLX)
import mlx.core as mx

from clp_mlx import api
from clp_mlx.bench.prompts import bench_texts, encode_prompts
from clp_mlx.decode import choose
from clp_mlx.decode.config import FEEDS
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
p.add_argument("--every-depth", action="store_true", help="also time each without the depth rule")
p.add_argument("--no-copies", action="store_true", help="also time each without context copies")
p.add_argument("--every-match", action="store_true", help="also time each copying every match")
p.add_argument("--feed", choices=FEEDS, default="cost", help="verify's feed rule")
p.add_argument("--per-prompt", action="store_true", help="print each prompt's tokens a pass")
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
    if args.every_depth and any(h.config.design != "mtp" for h in drafters.values()):
        raise ClpError("--every-depth times an MTP layer's depth rule; a drafter given has none")
    texts, kind = bench_texts(args.wikitext, args.prompts, args.n)
    prompts, _ = encode_prompts(tokenizer, texts, kind)
except ClpError as e:
    sys.exit(f"compare_drafters.py: {e}")

stops, real_rule = Counter(), choose.depth_rule


def counted(model, config, k):
    rule = real_rule(model, config, k)
    if rule is None:
        return None

    def stop(alive):
        stopped = rule(alive)
        stops[len(alive) - 1, stopped] += 1
        return stopped

    return stop


def run(prompt, way):
    """``way``: None (ar), or (drafter, with the depth rule or not, copies: "" (as
    decoding chooses), "no copies" or "every match")."""
    drafter, rule, copies = way or (None, True, "")
    choose.depth_rule = counted if rule else (lambda *a: None)
    choose.COPY_HEAD_SHORTEST = 1 if copies == "every match" else 0
    config = api.decode_config(
        mode="ar" if drafter is None else "verify",
        max_tokens=args.m,
        feed=args.feed,
        lookup=False if copies == "no copies" else None,
    )
    tic = time.perf_counter()
    steps = list(decode(mx.array(prompt), model, drafters.get(drafter), config))
    return time.perf_counter() - tic, [t for s in steps for t in s.tokens], len(steps)


ways = [None, *((d, True, "") for d in drafters)]
ways += [(d, False, "") for d in drafters] if args.every_depth else []
ways += [(d, True, "no copies") for d in drafters] if args.no_copies else []
ways += [(d, True, "every match") for d in drafters] if args.every_match else []
for way in ways:
    run(prompts[0], way)  # warm
stops.clear()
times = {w: [[] for _ in prompts] for w in ways}
passes = {w: [0] * len(prompts) for w in ways}
made = [0] * len(prompts)  # tokens per prompt: fewer than -m where EOS comes first
for r in range(args.rounds):
    for i, prompt in enumerate(prompts):
        out = {}
        for way in ways[:: -1 if r % 2 else 1]:
            seconds, tokens, passes[way][i] = run(prompt, way)
            times[way][i].append(seconds)
            out[way] = tokens
        assert all(t == out[None] for t in out.values()), f"prompt {i}: outputs differ"
        made[i] = len(out[None])
        for d in drafters if args.every_depth else ():
            assert passes[d, True, ""][i] == passes[d, False, ""][i], (
                f"prompt {i}: {d}: passes differ"
            )
med = {w: [st.median(t) for t in times[w]] for w in ways}
tokens = sum(made)


def versus(a, b, what):
    per = [x / y for x, y in zip(med[a], med[b])]
    print(f"{what}, per prompt: median {st.median(per):.3f} ({min(per):.3f}-{max(per):.3f}), "
          f"faster on {sum(x > 1 for x in per)} of {len(per)}")  # fmt: skip


def label(way):
    return way[0] + ("" if way[1] else " (every depth)") + (f" ({way[2]})" if way[2] else "")


print(f"ar: {tokens / sum(med[None]):.2f} tokens/s, {len(prompts)} prompts, {args.rounds} rounds")
for way in ways[1:]:
    per = [a / b for a, b in zip(med[None], med[way])]
    print(f"{label(way)}: {sum(med[None]) / sum(med[way]):.3f}x in all; per prompt median "
          f"{st.median(per):.3f}x ({min(per):.2f}-{max(per):.2f}); "
          f"{tokens / sum(passes[way]):.2f} tokens a pass")  # fmt: skip
first, last = args.drafters[0], args.drafters[-1]
if first != last:
    versus((first, True, ""), (last, True, ""), f"{last} over {first}")
for d in drafters if args.every_depth else ():
    versus((d, False, ""), (d, True, ""), f"{d}: depth rule over every depth")
for other, asked in (("no copies", args.no_copies), ("every match", args.every_match)):
    for d in drafters if asked else ():
        versus((d, True, ""), (d, True, other), f"{d}: {other} over as decoding chooses")
if args.per_prompt:
    print("tokens a pass per prompt:")
    for way in ways[1:]:
        print(f"  {label(way)}: " + " ".join(f"{m / n:.2f}" for m, n in zip(made, passes[way])))  # fmt: skip
if args.every_depth:
    print("stops by depth (depth, stopped): count", dict(sorted(stops.items())))
