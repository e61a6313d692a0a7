"""Where the time of one decode step goes: ``python -m clp_mlx.bench_step``.

Times, on a warm KV cache, the backbone pass over n = 1..k+1 new tokens (with
the output projection of those n rows and the greedy choice: what ``ar``
pays per token at n = 1), and the full step graphs of ``clp`` (1 token fed)
and ``verify`` (k+1 tokens fed): their extra over the backbone pass of the
same width is drafting + CLP + verification. Configurations are interleaved
and each figure is the median of several runs. Then the host's share of a
step: building a verify step's graph, the heads' drafts asked for after the
pass (a step with no context match that feeds drafts), the context drafter,
and detokenizing one token (generate's streaming). A benchmark, not a test.

An MTP layer drafts after the pass, with a cache of its own: for one, the
verify pass (k+1 fed, with the check) and the layer's work after a pass that
accepted 1 or k+1 positions (their entry into its cache, then every depth's
draft; in decoding verify's depth rule often stops sooner) are timed instead.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from ..api import load_with_drafter as load
from ..decode.config import DecodeConfig
from ..decode.drafters import HeadsDrafter, PassDrafts
from ..decode.lookup import ContextDrafter
from ..decode.mtp_drafter import MTPDrafter
from ..decode.sampling import Sampler, Sampling, greedy
from ..decode.tree import Tree
from ..decode.unchecked import unchecked_step
from ..decode.verify import one_pass
from ..errors import ClpError
from ..model import backbone
from ..native.padrows import ROWS
from .args import parser, run


def _verify(model, drafter, fed: Tree, cache):
    """A greedy verify step's graph: the pass, the check and the drafter's part
    (the chain heads' drafts and CLP; an MTP layer's: the fed rows' states)."""
    done = one_pass(model, drafter, fed, cache)
    return [done.choices, done.accepted, *done.drafts.lazy()]


def _tree(tokens: list, k: int) -> Tree:
    """A full tree of ROWS tokens: branches of k drafts after tokens[0]."""
    rest = tokens[1:]
    return Tree.build(tokens[0], [rest[i : i + k] for i in range(0, len(rest), k)], ROWS)


def _timed(fn, cache, tokens) -> float:
    tic = time.perf_counter()
    mx.eval(fn(tokens))
    dt = time.perf_counter() - tic
    trim_prompt_cache(cache, tokens.size)
    return dt


def _interleaved(configs: dict, cache, vocab: int, repeats: int) -> dict:
    """Median milliseconds of each ``name: (fn, n tokens)``, interleaved."""
    times = {name: [] for name in configs}
    for r in range(repeats + 2):  # two warm-up rounds
        for name, (fn, n) in configs.items():
            dt = _timed(fn, cache, mx.random.randint(0, vocab, (n,)).astype(mx.uint32))
            if r >= 2:
                times[name].append(dt)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def measure(model, heads, *, context: int = 100, repeats: int = 7) -> dict:
    k = heads.k
    cache = make_prompt_cache(model)
    mx.random.seed(0)
    vocab = model.args.vocab_size
    history = mx.random.randint(0, vocab, (context,)).astype(mx.uint32)
    # An MTP layer watches the earlier layers it reads from its first pass on.
    drafter = MTPDrafter(model, heads) if heads.config.design == "mtp" else None
    h = backbone.hidden_states(model, history, cache)
    mx.eval([c.state for c in cache])

    def plain(tokens):
        return greedy(backbone.project(model, backbone.hidden_states(model, tokens, cache)))

    widths = {f"backbone x{n}": (plain, n) for n in range(1, k + 2)}
    if drafter is not None:  # no depth rule: every depth drafts
        drafter.prompt(h, history)
        return _measure_mtp(model, drafter, cache, widths, repeats)
    clp = DecodeConfig(mode="clp").resolve(model, heads)
    drafter, sampler = HeadsDrafter(model, heads), Sampler(Sampling())

    def clp_step(tokens):
        b, d, n, got = unchecked_step(model, heads, drafter, tokens, cache, clp, sampler)
        return [b, d, n, got.scores]

    def verify(tokens):
        return _verify(model, drafter, Tree.chain(tokens.tolist()), cache)

    def verify_tree(tokens):
        return _verify(model, drafter, _tree(tokens.tolist(), k), cache)

    configs = {**widths, f"backbone x{ROWS}": (plain, ROWS)}
    configs["clp step (1 fed)"] = (clp_step, 1)
    configs[f"verify step ({k + 1} fed)"] = (verify, k + 1)
    configs[f"verify step (tree of {ROWS})"] = (verify_tree, ROWS)
    return _interleaved(configs, cache, vocab, repeats)


def _measure_mtp(model, drafter, cache, widths: dict, repeats: int) -> dict:
    """The MTP layer: the verify pass, and the layer's work after a pass."""
    k, vocab = drafter.k, model.args.vocab_size

    def verify(tokens):
        return _verify(model, drafter, Tree.chain(tokens.tolist()), cache)

    configs = {**widths, f"verify pass ({k + 1} fed)": (verify, k + 1)}
    ms = _interleaved(configs, cache, vocab, repeats)
    for n in (1, k + 1):
        times = [_drafting(model, drafter, cache, n) for _ in range(repeats + 2)]
        ms[f"MTP layer after {n} accepted ({k} depths)"] = statistics.median(times[2:]) * 1e3
    return ms


def _drafting(model, drafter, cache, n: int) -> float:
    """Seconds the layer takes after a pass of ``n`` tokens, all accepted: their
    entry into its cache, then every depth. The pass is outside the clock; both
    caches are as before after it."""
    tokens = mx.random.randint(0, model.args.vocab_size, (n,)).astype(mx.uint32)
    fed = backbone.hidden_states(model, tokens, cache)
    mx.eval(fed, *[s[-1] for s in (drafter.side or {}).values()])
    tic = time.perf_counter()
    drafter.observe(tokens.tolist(), PassDrafts(None, None, None, fed=fed))
    seconds = time.perf_counter() - tic
    trim_prompt_cache(cache, n)
    drafter.cache.trim(n)
    drafter.offset -= n
    drafter.unplaced = [None]
    return seconds


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def host_costs(model, heads, tokenizer, *, context: int = 100, repeats: int = 7) -> dict:
    """Milliseconds of the per-step work around the backbone pass."""
    k, mtp = heads.k, heads.config.design == "mtp"
    cache = make_prompt_cache(model)
    mx.random.seed(1)
    history = mx.random.randint(0, model.args.vocab_size, (context,)).astype(mx.uint32)
    h = backbone.hidden_states(model, history, cache)[-1:]
    mx.eval(h, [c.state for c in cache])
    fed = Tree.chain(history[: k + 1].tolist()) if mtp else _tree(history[:ROWS].tolist(), k)
    drafter = MTPDrafter(model, heads) if mtp else HeadsDrafter(model, heads)

    def build():  # the graph only; evaluated (and trimmed) outside the clock
        tic = time.perf_counter()
        out = _verify(model, drafter, fed, cache)
        built.append(time.perf_counter() - tic)
        mx.eval(out)
        trim_prompt_cache(cache, len(fed))

    built = []
    for _ in range(repeats + 1):
        build()
    words = history.tolist()
    context_drafter = ContextDrafter(words, heads.config.lookup or 3)

    def detokenize():
        detok = tokenizer.detokenizer
        detok.reset()
        for t in words[:32]:
            detok.add_token(t)
        detok.finalize()

    b = mx.array([words[-1]], dtype=mx.uint32)
    width = (ROWS - 1) // k
    graph = "chain" if mtp else "tree"
    out = {f"build a verify step's graph ({graph})": statistics.median(built[1:]) * 1e3}
    if not mtp:  # the MTP layer's drafting is timed in measure()
        out["heads' drafts after the pass"] = _median_ms(
            lambda: heads.draft_branches(model, h, b, 1).tolist(), repeats
        )
        out[f"heads' {width} branches after the pass"] = _median_ms(
            lambda: heads.draft_branches(model, h, b, width).tolist(), repeats
        )
    out["context drafter (extend + propose)"] = _median_ms(
        lambda: (context_drafter.extend(words[:1]), context_drafter.propose(k)), repeats
    )
    out["detokenize one token"] = _median_ms(detokenize, repeats) / 32
    return out


def main(argv=None) -> int:
    p = parser("python -m clp_mlx.bench_step", __doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as for generate (default: the 0.5B)")
    p.add_argument("--heads", default=None, help="heads folder (default: untrained heads)")
    p.add_argument("--num-draft-tokens", "-k", type=int, default=3)
    p.add_argument("--context", type=int, default=100, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", choices=sorted(backbone.DTYPES), default=None)
    args = p.parse_args(argv)
    if args.context < 1 or args.repeats < 1:
        raise ClpError("--context and --repeats must be at least 1")
    model, tokenizer, heads = load(
        args.model,
        "init" if args.heads is None else args.heads,
        dtype=args.dtype,
        num_draft_tokens=args.num_draft_tokens,
    )
    room = (backbone.context_length(model) or args.context + ROWS) - ROWS
    if args.context > room:
        raise ClpError(f"--context must be at most {room} for this model's context")
    ms = measure(model, heads, context=args.context, repeats=args.repeats)
    k = heads.k
    plain = ms["backbone x1"]
    print(
        f"| step (k={k}, context {args.context}) | ms (median of {args.repeats}) | vs plain step |"
    )
    print("| --- | ---: | ---: |")
    for name, v in ms.items():
        print(f"| {name} | {v:.1f} | {v / plain:.2f}x |")
    if heads.config.design == "mtp":
        step = ms[f"verify pass ({k + 1} fed)"]
        step += ms[f"MTP layer after {k + 1} accepted ({k} depths)"]
        print(f"\nverify, {k + 1} fed and all accepted: pass + the layer = {step:.1f} ms "
              f"({step / plain:.2f}x a plain step)")  # fmt: skip
    else:
        clp_extra = ms["clp step (1 fed)"] - plain
        ver_extra = ms[f"verify step ({k + 1} fed)"] - ms[f"backbone x{k + 1}"]
        print(f"\nclp: drafting + CLP = {clp_extra:.1f} ms "
              f"({clp_extra / plain:.1%} of a plain step)")  # fmt: skip
        print(f"verify: drafting + verification = {ver_extra:.1f} ms "
              f"({ver_extra / plain:.1%} of a plain step)")  # fmt: skip
    print("\n| host work per step | ms | vs plain step |\n| --- | ---: | ---: |")
    for name, v in host_costs(model, heads, tokenizer, context=args.context).items():
        print(f"| {name} | {v:.2f} | {v / plain:.1%} |")
    return 0


def cli() -> None:
    run(main)


if __name__ == "__main__":
    cli()
