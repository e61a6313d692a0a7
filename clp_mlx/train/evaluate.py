"""How trained heads draft on cached features: the drafts, their scores
against the backbone's greedy choice and the text, and the evaluation report
(``python -m clp_mlx.train --eval``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..decode.lookup import row_drafts
from .trainer import Positions, head_drafts, run_lengths, walked_tokens_per_pass

SMALL_SAMPLE = 4096  # positions for CLP/gate training and evaluation
WALK_POSITIONS = 2 * SMALL_SAMPLE  # evaluation walks whole rows, up to this many positions


def sampled_drafts(model, bundle, data: Positions, n: int, seed: list, lookup: int = 0):
    """``n`` positions of ``data`` drawn with ``seed``, the heads' drafts
    there (n, k), the drafts decoding makes there (with ``lookup``, the
    context's copy where it has a match; else the heads') and the match
    lengths (n,). The heads run once for both."""
    idx = np.random.default_rng(seed).choice(len(data), min(len(data), n), replace=False)
    return drafts_at(model, bundle, data, idx, lookup)


def drafts_at(model, bundle, data: Positions, idx: np.ndarray, lookup: int = 0):
    """As :func:`sampled_drafts`, at the positions ``idx`` of ``data``."""
    at = data.index[idx]
    heads = head_drafts(model, bundle, data, idx)
    if not lookup:
        return at, heads, heads, np.zeros(at.size, dtype=np.int64)
    copied, match = row_drafts(data.rows, at, bundle.k, lookup)
    return at, heads, np.where(match[:, None] > 0, copied, heads), match


def scores(data: Positions, at: np.ndarray, drafts: np.ndarray):
    """Per draft, whether it equals the backbone's greedy token and the
    text's token at its position: both (n, k)."""
    ahead = at[:, None] + np.arange(1, drafts.shape[1] + 1)[None]
    return drafts == data.greedy[ahead], drafts == data.tokens[ahead + 1]


def evaluate(model, bundle, data: Positions, seed: int = 0, n: int = SMALL_SAMPLE) -> dict:
    """Top-1 of each head vs the backbone's greedy and vs the text, alone and
    (bundles with context drafts) as decoding drafts; CLP's confusion."""
    lookup = bundle.config.lookup
    at, heads, drafts, match = sampled_drafts(model, bundle, data, n, [seed, 2], lookup)
    agree, truth = scores(data, at, heads)
    backbone_acc = float((data.greedy[at] == data.tokens[at + 1]).mean())
    out = {
        "positions": int(at.size),
        "head_top1_vs_greedy": agree.mean(axis=0).round(4).tolist(),
        "head_top1_vs_text": truth.mean(axis=0).round(4).tolist(),
        "backbone_top1_vs_text": round(backbone_acc, 4),
        "expected_tokens_per_pass_verify": round(1 + float(run_lengths(agree).mean()), 3),
    }
    if lookup:
        agree, truth = scores(data, at, drafts)
        out["with_context_drafts"] = {
            "draft_top1_vs_greedy": agree.mean(axis=0).round(4).tolist(),
            "draft_top1_vs_text": truth.mean(axis=0).round(4).tolist(),
            "context_match_share": round(float((match > 0).mean()), 4),
            "expected_tokens_per_pass_verify": round(1 + float(run_lengths(agree).mean()), 3),
        }
    out["chain_verify_tokens_per_pass"] = walked_verify(model, bundle, data)
    out.update(clp_confusion(bundle, data, at, run_lengths(agree), match if lookup else None))
    return out


def clp_confusion(bundle, data: Positions, at: np.ndarray, label: np.ndarray, match) -> dict:
    """CLP's predicted run at positions ``at`` against the true run ``label``."""
    h = mx.array(data.hidden[at], dtype=mx.float32)
    pred = np.array(bundle.clp_length(h, None if match is None else mx.array(match)))
    confusion = np.zeros((bundle.k + 1, bundle.k + 1), dtype=int)
    np.add.at(confusion, (label, pred), 1)
    return {
        "clp_confusion_rows_label_cols_pred": confusion.tolist(),
        "clp_accuracy": round(float(np.trace(confusion) / at.size), 4),
    }


def walked_verify(model, bundle, data: Positions) -> dict:
    """Tokens per pass of chain verify, walking every row as decoding does:
    with the heads' drafts alone and (bundles with context drafts) with the
    drafts decoding makes. 1 + the mean run over positions counts a long
    run once per position inside it; decoding passes over it once. The
    first rows up to WALK_POSITIONS: drafting every position of a large
    --max-tokens would cost minutes per thousand rows."""
    rows = max(1, WALK_POSITIONS // data.per_row)
    first = np.arange(min(len(data), rows * data.per_row))  # index is row-major
    at, heads, drafts, _ = drafts_at(model, bundle, data, first, bundle.config.lookup)

    def walk(d):
        runs = run_lengths(scores(data, at, d)[0]).reshape(-1, data.per_row)
        return round(walked_tokens_per_pass(runs), 3)

    out = {"heads": walk(heads)}
    if bundle.config.lookup:
        out["with_context"] = walk(drafts)
    return out
