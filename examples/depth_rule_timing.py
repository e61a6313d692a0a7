"""Time verify with and without the MTP layer's depth rule, in one process.

    python examples/depth_rule_timing.py MODEL PROMPTS NEW_TOKENS ROUNDS {WIKI.TEST.RAW,chat}

For each prompt, interleaved (the order reversed every other round): plain
greedy decoding (ar), verify drafting every depth of the layer, and verify
with the rule (decode/feed.py: deeper_cannot_pay). Outputs must be identical
and the two verifies must take the same number of passes; prints each
speed-up over ar (median of the rounds per prompt) and how often the rule
stopped at each depth. WikiText prompts are the bench's (openings of
WikiText-2's wiki.test.raw, 64 tokens); chat prompts are
examples/instructions.jsonl, then code_edits.jsonl.
"""

import statistics as st
import sys
import time
from collections import Counter
from pathlib import Path

import clp_mlx  # noqa: F401  (loads OpenBLAS before MLX)
import mlx.core as mx

from clp_mlx import api
from clp_mlx.bench.prompts import encode_prompts, instruction_prompts, wikitext_prompts
from clp_mlx.decode import choose
from clp_mlx.decode.loop import decode
from clp_mlx.errors import ClpError

USAGE = "usage: depth_rule_timing.py MODEL PROMPTS NEW_TOKENS ROUNDS {WIKI.TEST.RAW,chat}"
try:
    name, kind = sys.argv[1], sys.argv[5]
    n, new, rounds = (int(a) for a in sys.argv[2:5])
    assert len(sys.argv) == 6 and min(n, new, rounds) > 0
except (IndexError, ValueError, AssertionError):
    sys.exit(USAGE)
try:
    model, tokenizer, heads = api.load_with_drafter(name)
    here = Path(__file__).parent
    if kind != "chat":
        texts, how = wikitext_prompts(kind, n), "wikitext"
    else:
        texts = [*instruction_prompts(str(here / "instructions.jsonl")),
                 *instruction_prompts(str(here / "code_edits.jsonl"))][:n]  # fmt: skip
        how = "instruction"
    prompts, _ = encode_prompts(tokenizer, texts, how)
except ClpError as e:
    sys.exit(f"depth_rule_timing.py: {e}")
if heads is None or heads.config.design != "mtp":
    sys.exit(f"depth_rule_timing.py: {name} has no MTP-layer drafter to time")

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


def run(prompt, mode, rule):
    choose.depth_rule = counted if rule else (lambda *a: None)
    config = api.decode_config(mode=mode, max_tokens=new)
    tic = time.perf_counter()
    steps = list(decode(mx.array(prompt), model, heads, config))
    return time.perf_counter() - tic, [t for s in steps for t in s.tokens], len(steps)


run(prompts[0], "verify", True), run(prompts[0], "ar", False)  # warm
stops.clear()
times = {key: [[] for _ in prompts] for key in ("ar", "every depth", "depth rule")}
ways = [("ar", "ar", False), ("every depth", "verify", False), ("depth rule", "verify", True)]
for r in range(rounds):
    for i, prompt in enumerate(prompts):
        out = {}
        for key, mode, rule in ways[:: -1 if r % 2 else 1]:
            seconds, tokens, passes = run(prompt, mode, rule)
            times[key][i].append(seconds)
            out[key] = tokens, passes
        assert out["ar"][0] == out["every depth"][0] == out["depth rule"][0], f"prompt {i}"
        assert out["every depth"][1] == out["depth rule"][1], f"prompt {i}: passes differ"
med = {key: [st.median(t) for t in per] for key, per in times.items()}
for key in ("every depth", "depth rule"):
    per = [a / b for a, b in zip(med["ar"], med[key])]
    print(f"{key}: {sum(med['ar']) / sum(med[key]):.3f}x over ar in all; per prompt median "
          f"{st.median(per):.3f}x ({min(per):.2f}-{max(per):.2f})")  # fmt: skip
per = [a / b for a, b in zip(med["every depth"], med["depth rule"])]
faster = sum(x > 1 for x in per)
print(f"rule / every depth, per prompt: median {st.median(per):.3f} "
      f"({min(per):.3f}-{max(per):.3f}), faster on {faster} of {len(per)}")  # fmt: skip
print("stops by depth (depth, stopped): count", dict(sorted(stops.items())))
