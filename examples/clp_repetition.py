"""Where clp mode's repetition comes from: its outputs against greedy's, prompt by prompt.

    python examples/clp_repetition.py --model MODEL --drafters A [B ...] \\
        (--wikitext wiki.test.raw | --prompts FILE [FILE ...]) [-n 15] [-m 64] \\
        [--thresholds Q ...] [--no-copy-head]

Decodes every prompt greedily (``ar``) and in clp mode with each drafter (a
drafter folder, or ``shipped``), by the paper's rule and by ``clp@Q`` for each
of ``--thresholds``; ``--no-copy-head`` also decodes each drafter that has a
copy head without it (its layer alone). No timing: the figures are the
outputs'. For each way it prints the mean repetition (1 - distinct 3-grams /
3-grams, as the bench), the outputs equal to greedy's, the median token where
an output first leaves greedy's, the share of its repeated 3-grams that start
past that token, the outputs that end in a loop (their last 24 tokens repeat
with a period of 12 or less; greedy's own loops counted apart), and how many
prompts hold half of the repetition above greedy's.
"""

import argparse
import statistics as st
import sys

import clp_mlx  # noqa: F401  (loads OpenBLAS before MLX)
import mlx.core as mx

from clp_mlx import api
from clp_mlx.bench.measures import common_prefix, repetition_ratio
from clp_mlx.bench.prompts import bench_texts, encode_prompts
from clp_mlx.decode.loop import decode
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import find_heads, load_heads

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--model", required=True)
p.add_argument("--drafters", nargs="+", required=True)
where = p.add_mutually_exclusive_group(required=True)
where.add_argument("--wikitext")
where.add_argument("--prompts", nargs="+")
p.add_argument("-n", type=int, default=15, help="prompts (default 15)")
p.add_argument("-m", type=int, default=64, help="new tokens (default 64)")
p.add_argument("--thresholds", type=float, nargs="*", default=[], help="also clp@Q")
p.add_argument("--no-copy-head", action="store_true", help="also each copy head's layer alone")
args = p.parse_args()
if min(args.n, args.m) < 1 or any(not 0 < q <= 1 for q in args.thresholds):
    sys.exit("clp_repetition.py: -n and -m must be 1 or more, thresholds in (0, 1]")


try:
    model, tokenizer, _ = api.load_with_drafter(args.model, "none")
    shipped = find_heads(model)
    if "shipped" in args.drafters and shipped is None:
        raise ClpError(f"no drafter is made for {args.model}: name a folder")
    drafters = {d: load_heads(shipped if d == "shipped" else d, model) for d in args.drafters}
    texts, kind = bench_texts(args.wikitext, args.prompts, args.n)
    prompts, _ = encode_prompts(tokenizer, texts, kind)
except ClpError as e:
    sys.exit(f"clp_repetition.py: {e}")


def run(prompt, heads, mode, q=None):
    config = api.decode_config(mode=mode, max_tokens=args.m, clp_threshold=q)
    return [t for s in decode(mx.array(prompt), model, heads, config) for t in s.tokens]


def loops(tokens, span=24, longest=12):
    tail = tokens[-span:]
    return len(tail) == span and any(
        all(tail[i] == tail[i + n] for i in range(span - n)) for n in range(1, longest + 1)
    )


def repeated_past(tokens, start):
    """Repeated 3-grams (each later sighting of one seen before), and how many start at or past ``start``."""
    seen, later, past = set(), 0, 0
    for i in range(len(tokens) - 2):
        g = tuple(tokens[i : i + 3])
        if g in seen:
            later, past = later + 1, past + (i >= start)
        seen.add(g)
    return later, past


greedy = [run(pr, None, "ar") for pr in prompts]
ways = [(d, q) for d in drafters for q in (None, *args.thresholds)]
outputs = {w: [run(pr, drafters[w[0]], "clp", w[1]) for pr in prompts] for w in ways}
for d in drafters if args.no_copy_head else ():
    layer = drafters[d].mtp
    if "pointer" in layer:  # mlx modules keep their children as dict items
        pointer = layer.pop("pointer")  # the layer drafts from its vocabulary alone
        for q in (None, *args.thresholds):
            outputs[d + " (no copy head)", q] = [run(pr, drafters[d], "clp", q) for pr in prompts]
        layer["pointer"] = pointer

base = [repetition_ratio(t) for t in greedy]
print(
    f"ar: repetition {st.mean(base):.4f}, {sum(map(loops, greedy))} of {len(prompts)} end in a loop"
)
for (d, q), outs in outputs.items():
    rep = [repetition_ratio(t) for t in outs]
    left = [common_prefix(t, g) for t, g in zip(outs, greedy)]
    counts = [repeated_past(t, s) for t, s in zip(outs, left)]
    excess = sorted((max(r - b, 0) for r, b in zip(rep, base)), reverse=True)
    total = sum(excess)  # prompts, most first, until they hold half of it (0: no excess)
    half = next(
        (i + 1 for i in range(len(excess)) if total and sum(excess[: i + 1]) >= total / 2), 0
    )
    new_loops = sum(loops(t) and not loops(g) for t, g in zip(outs, greedy))
    print(f"{d} clp{'' if q is None else f'@{q}'}: repetition {st.mean(rep):.4f} "
          f"(+{st.mean(rep) - st.mean(base):.4f}); {sum(t == g for t, g in zip(outs, greedy))} "
          f"identical; leaves greedy at token {st.median(left):.0f} (median); "
          f"{sum(c[1] for c in counts)} of {sum(c[0] for c in counts)} repeated 3-grams past it; "
          f"{new_loops} new loops; half the excess in {half} prompts")  # fmt: skip
