"""Any drafter on the held-out rows of self-distilled data (docs/DATA.md):
``python -m clp_mlx.train --eval --heads FOLDER --data DISTILL_FOLDER``.

At every anchor ``s`` of a row's continuation the drafter drafts
``x_{s+2} .. x_{s+1+k}`` from the backbone's hidden state there and its
token ``x_{s+1}``. Later drafts read the drafter's earlier ones, as
decoding does (the MTP layer: in one unrolled pass). So ``accepted_by_depth`` (every
draft up to t+j right: how often chain verify accepts the draft at t+j) and
``conditional_by_depth`` (the draft at t+j right when the ones before it are)
mean the same for every design.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..decode.choose import copy_shortest
from ..decode.lookup import row_drafts
from ..decode.mtp_drafter import RUNNERS_UP, draft_chance, run_scores, runners_up, temperatures
from ..errors import ClpError
from ..model import backbone
from ..model.heads import accept_count
from ..model.pointer import copy_context, draft_ids, id_map
from .fed_walk import fed_steps, summary
from .mtp_data import Rows
from .trainer import walked_tokens_per_pass


def chain_drafts(model, bundle, hidden, tokens, seen: list | None = None, others=None):
    """Drafts (B, L, k) at every anchor of ``hidden`` (B, L, d), and CLP's
    scores (B, L, k + 1) over accepting 0..k of them; ``tokens``
    (B, >= L + k + 1) are the rows' tokens. The MTP layer's CLP is its own
    chance of each run (:func:`run_scores`), from each depth's probability
    of its draft; ``seen`` (a list) gets each depth's scores (B, L, V'),
    ``others`` its best ``RUNNERS_UP`` + 1 token ids and chances (B, L, R + 1)."""
    k, (rows, length, width) = bundle.k, hidden.shape
    if bundle.config.design == "mtp":
        layer, ids, probs, temps = bundle.mtp, [], [], temperatures(bundle)
        first = lambda j: backbone.embed(model, tokens[:, 1 : 1 + length])
        copy = copy_head(model, bundle, hidden, tokens, first(1))

        def read(g):  # a depth's draft, and the layer's probability of it
            scores, vocab = bundle._draft_scores(model, layer.readout(model.model.norm, g))
            if copy is not None:  # columns past the draft vocabulary: copies of other tokens
                scores, vocab = copy(scores, g)
            if seen is not None:
                seen.append(scores.astype(mx.float32))
            if others is not None:  # as decoding's runners-up: decode/mtp_drafter.py
                top, chances = runners_up(scores, None, temps[len(probs)], RUNNERS_UP)
                others.append((_ids(vocab, top), chances))
            ids.append(_ids(vocab, mx.argmax(scores, axis=-1, keepdims=True))[..., 0])
            probs.append(draft_chance(scores, temps[len(probs)]))
            return backbone.embed(model, ids[-1].astype(mx.uint32))

        read(layer.unrolled(hidden, first, k, model.model.norm, drafted=read)[-1])
        return np.array(mx.stack(ids, axis=-1)), np.array(run_scores(mx.stack(probs, axis=-1)))
    flat = hidden.reshape(-1, width)
    after = tokens[:, 1 : length + 1].reshape(-1).astype(mx.uint32)
    drafts, _ = bundle.draft(model, flat, after)
    clp = bundle.clp_logits(flat).astype(mx.float32)
    return np.array(drafts).reshape(rows, length, k), np.array(clp).reshape(rows, length, k + 1)


def _ids(vocab, columns: mx.array) -> mx.array:
    """The token ids of draft-score ``columns`` (B, L, n): ``vocab`` None (the
    columns are ids), its ids (V') or each row's own (B, 1, V' + L)."""
    if vocab is None:
        return columns
    if vocab.ndim > 1:
        return mx.take_along_axis(vocab, columns, axis=-1)
    return vocab[columns]


def copy_head(model, bundle, hidden, tokens, emb):
    """None, or for an MTP layer with a copy head: a function of a depth's
    scores (B, L, V') and outputs (B, L, d) giving the mixture's and the
    token ids of its columns (with copies outside the draft vocabulary,
    (B, L, V' + L) and each row's own (B, 1, V' + L)), where
    anchor ``s`` copies ``x_{m+2}`` of the positions ``m < s`` (model/pointer.py)."""
    layer, length = bundle.mtp, hidden.shape[1]
    if "pointer" not in layer:
        return None
    vocab = bundle.draft_vocab if "draft_vocab" in bundle else None
    offered = np.array(tokens[:, 2 : 2 + length])
    context = copy_context(offered, id_map(vocab, model.args.vocab_size))
    ids = vocab  # or each row's own, with columns for copies outside the vocabulary
    if layer.pointer.outside:
        ids = draft_ids(vocab, model.args.vocab_size, mx.array(offered))[:, None]
    keys = layer.pointer.keys(layer.fuse(hidden, emb))
    valid = mx.arange(length)[None] < mx.arange(length)[:, None]
    return lambda scores, g: (layer.pointer.mix(scores, g, keys, valid, context), ids)


def targets(tokens: np.ndarray, starts, ends, length: int, k: int):
    """For every anchor ``s < length`` and depth: the token its draft of
    ``x_{s+2} .. x_{s+1+k}`` should be (B, L, k), and whether that token is
    a greedy one (inside the row's continuation)."""
    at = np.arange(length)[None, :, None] + np.arange(2, k + 2)[None, None]
    target = tokens[:, np.minimum(at[0], tokens.shape[1] - 1)]
    return target, (at < ends[:, None, None]) & (at >= starts[:, None, None])


def side_layers(bundle, rows: Rows) -> tuple:
    """The earlier layers the drafter reads (none but for an MTP layer that
    reads them), refused unless the rows keep those."""
    side = bundle.mtp.side_layers if bundle.config.design == "mtp" else ()
    if side and side != rows.side_layers:
        kept = list(rows.side_layers) or "none"
        raise ClpError(f"the drafter reads the states after layers {list(side)}; the data "
                       f"keeps {kept} (distill --side-layers)")  # fmt: skip
    return side


def evaluate_rows(
    model, bundle, rows: Rows, lookup: int = 0, batch_rows: int = 8, by_confidence: bool = False,
    costs: list | None = None,
    leaves: bool = True,
) -> dict:
    """The report on ``rows``: per depth, how often the draft is right alone
    and with the ones before it, and chain verify's tokens per pass walking
    every row as decoding does; the acceptance and the walk also over each
    row's first ``EARLY`` anchors alone, where text is least repetitive (with
    ``lookup``: also with context copies where verify drafts them, after
    matches of at least ``copy_shortest`` tokens (``CopyThenHeads``,
    ``CopiesFirst``), cut at ``k`` tokens here); and clp mode's tokens
    a pass and share of passes that commit a wrong draft, at CLP's most likely
    run and at thresholds.
    ``by_confidence``: also t+2 by the backbone's own chance of its token
    there, and how many misses the row had shown before (:func:`_by_confidence`).
    ``costs`` (an MTP layer's; pass times over 1, 2, ... tokens): also the walk
    as verify's feed rule feeds it, with runners-up as leaves unless not
    ``leaves`` (train/fed_walk.py)."""
    k, side = bundle.k, side_layers(bundle, rows)
    fed = [] if costs and bundle.config.design == "mtp" else None
    binned = {"chance": [], "right": [], "in_row": []}
    hits = positions = 0
    runs_in, early_in, decided = [], [], {t: [] for t in THRESHOLDS}
    walks = {"drafter": [], "with_copies": []}
    shortest = copy_shortest(bundle, lookup) if lookup else 0
    for start in range(0, len(rows), batch_rows):
        idx = np.arange(start, min(len(rows), start + batch_rows))
        hidden, tokens, starts, ends = rows.gather(idx, k, bool(side))
        given = (model, bundle, mx.array(hidden), mx.array(np.maximum(tokens, 0)))
        others = [] if fed is not None else None  # (test stubs of chain_drafts take none)
        drafts, clp = chain_drafts(*given) if others is None else chain_drafts(*given, others=others)
        if others:
            alt_ids = np.stack([np.array(i) for i, _ in others], axis=2)  # (B, L, k, R + 1)
            alt_chances = np.stack([np.array(c) for _, c in others], axis=2)
        counts = {t: np.array(accept_count(mx.array(clp), t)) for t in THRESHOLDS}
        target, inside = targets(tokens, starts, ends, rows.length, k)
        right = (drafts == target) & inside
        runs = np.cumprod(right, axis=-1).sum(-1)  # (B, L)
        if lookup:
            copied, match = row_drafts(tokens, _anchors(tokens, starts, ends), k, lookup)
            match = np.where(match >= shortest, match, 0)
        for r in range(len(idx)):
            span = slice(starts[r] - 1, ends[r] - 1)  # anchors whose t+1 is a greedy token
            hits += int(right[r, span, 0].sum())
            positions += int(inside[r, span, 0].sum())
            inner = slice(starts[r] - 1, ends[r] - 1 - k)  # every depth inside
            runs_in.append(runs[r, inner])
            early_in.append(runs[r, inner][:EARLY])
            for t, n in counts.items():
                decided[t].append(n[r, inner])
            walks["drafter"].append(runs[r, span])
            if fed is not None:
                fed.append(fed_steps(runs[r, span], drafts[r, span], target[r, span],
                                     alt_ids[r, span], alt_chances[r, span], costs, k,
                                     leaves))  # fmt: skip
            if by_confidence:
                scored = inside[r, span, 0]
                wanted = target[r, span, 0]
                chance = backbone_chance(model, hidden[r, starts[r] : ends[r]], wanted)
                binned["chance"].append(chance[scored])
                binned["right"].append(right[r, span, 0][scored])
                binned["in_row"].append(_in_row(tokens[r], starts[r] + 1, wanted)[scored])
        if lookup:
            walks["with_copies"] += _with_copies(
                drafts, copied, match, target, inside, starts, ends
            )
    run = np.concatenate(runs_in)
    accepted = _accepted(run, k)
    out = {
        "rows": len(rows),
        "positions": positions,
        "agreement_t+2": round(hits / max(1, positions), 4),
        "accepted_by_depth": _by_depth(accepted),
        "conditional_by_depth": _by_depth(
            a / max(b, 1e-9) for a, b in zip(accepted, [1.0, *accepted])
        ),
        f"accepted_by_depth_first_{EARLY}": _by_depth(_accepted(np.concatenate(early_in), k)),
    }
    for name, runs in walks.items():
        if name == "drafter" or lookup:
            key = "walked_tokens_per_pass" if name == "drafter" else "walked_with_copies"
            out[key] = round(walked_tokens_per_pass(runs), 3)
            early = [r[:EARLY] for r in runs]
            out[f"{key}_first_{EARLY}"] = round(walked_tokens_per_pass(early), 3)
    if fed is not None:
        out["walked_as_fed"] = summary(fed, costs)
    out["clp_mode"] = {_name(t): _unchecked(np.concatenate(n), run) for t, n in decided.items()}
    if by_confidence:
        out.update(_by_confidence(*(np.concatenate(v) for v in binned.values())))
    return out


# Bins of the backbone's chance of its own greedy token (docs/EXPERIMENTS.md,
# "Where the 1.5B's drafts miss").
CONFIDENCE_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def backbone_chance(model, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The backbone's probability of ``tokens[i]`` from its state ``hidden[i]``
    (the last layer's, before any earlier layers' states kept beside it)."""
    h = mx.array(hidden[:, : model.args.hidden_size])
    logits = backbone.project(model, h).astype(mx.float32)
    chosen = mx.take_along_axis(logits, mx.array(np.maximum(tokens, 0))[:, None], axis=-1)[:, 0]
    return np.array(mx.exp(chosen - mx.logsumexp(logits, axis=-1)))


def _in_row(tokens: np.ndarray, start: int, wanted: np.ndarray) -> np.ndarray:
    """Per anchor, whether its t+2 token ``wanted[i]`` occurs in the row
    before it (the row's tokens up to ``start + i``)."""
    before = set(tokens[:start].tolist())
    out = np.zeros(len(wanted), dtype=bool)
    for i, t in enumerate(wanted.tolist()):
        out[i] = t in before
        before.add(int(tokens[start + i]))
    return out


def _by_confidence(chance, right, in_row) -> dict:
    """t+2 agreement per bin of the backbone's chance of its token (and each
    bin's share of positions); the share of misses whose token the row held
    before, which a copy from the context could draft."""
    mean = lambda a: round(float(a.mean()), 4) if a.size else None
    bins = {}
    for lo, hi in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:]):
        inside = (chance >= lo) & ((chance < hi) | (hi == CONFIDENCE_BINS[-1]))
        bins[f"{lo}-{hi}"] = {"share": mean(inside) or 0.0, "t+2": mean(right[inside]),
                              "misses_in_row": mean(in_row[inside & ~right])}  # fmt: skip
    return {
        "t+2_by_backbone_chance": bins,
        "backbone_chance_mean": mean(chance),
        "t+2_misses_in_row": mean(in_row[~right]),
    }


# The first tokens after a prompt are the hardest to draft (docs/EXPERIMENTS.md, "The
# MTP layer on 500k positions"): the walk over a row's first EARLY alone is what a short
# answer (the bench's) sees.
EARLY = 32
THRESHOLDS = (None, 0.7, 0.8, 0.9)  # CLP's most likely run, or the longest this likely


def _accepted(run: np.ndarray, k: int) -> list[float]:
    """Per depth, the share of anchors whose accepted run reaches it."""
    return [float((run > j).mean()) for j in range(k)]


def _by_depth(values) -> dict:
    return {f"t+{j + 2}": round(v, 4) for j, v in enumerate(values)}


def _name(threshold) -> str:
    return "most_likely" if threshold is None else f"p>={threshold}"


def _unchecked(n: np.ndarray, run: np.ndarray) -> dict:
    """clp mode, committing ``n`` drafts unchecked where ``run`` are right:
    tokens a pass, and the share of passes that commit a wrong draft."""
    return {
        "tokens_per_pass": round(1 + float(n.mean()), 3),
        "wrong_commit_share": round(float((n > run).mean()), 4),
    }


def _anchors(tokens: np.ndarray, starts, ends) -> np.ndarray:
    """Flat indices into ``tokens`` of every row's anchors, row by row."""
    width = tokens.shape[1]
    return np.concatenate(
        [r * width + np.arange(s - 1, e - 1) for r, (s, e) in enumerate(zip(starts, ends))]
    )


def _with_copies(drafts, copied, match, target, inside, starts, ends) -> list[np.ndarray]:
    """Per row, the accepted runs when a context match's copy replaces the drafts."""
    out, n = [], 0
    for r, (s, e) in enumerate(zip(starts, ends)):
        span = slice(s - 1, e - 1)
        size = e - s
        use = np.where(match[n : n + size, None] > 0, copied[n : n + size], drafts[r, span])
        n += size
        out.append(np.cumprod((use == target[r, span]) & inside[r, span], axis=-1).sum(-1))
    return out


def score_folders(
    model, bundle, dirs: list, lookup: int = 0, by_confidence=False, costs=None, leaves=True
) -> dict:
    """:func:`evaluate_rows` on each distilled folder's held-out rows, by folder name."""
    return {
        Path(d).name: evaluate_rows(
            model, bundle, Rows.for_model([d], model.args, True), lookup,
            by_confidence=by_confidence, costs=costs, leaves=leaves,
        )
        for d in dirs
    }
