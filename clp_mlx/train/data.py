"""Which rows the heads learn from: tokenized text or the backbone's own
greedy continuations of prompts cut from it, and the held-out rows.

The features themselves are extracted (once, resumably) by
:mod:`clp_mlx.train.features`; this module decides what to extract and
splits the result into training and held-out positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ClpError
from .features import continue_greedily, extract, load_features, tokenize_files
from .trainer import Positions

HELD_SHARE = 0.1  # rows (whole prompts) kept out of head training
PROMPT_STRIDE = 4  # prompts for source "greedy": one per 4 prompt lengths of text


@dataclass
class FeatureSource:
    """What the features are of (the training command's data flags).

    ``source``: "greedy", the backbone's greedy continuations of prompts of
    ``prompt_tokens`` tokens cut from the text, ``new_tokens`` each; "text",
    the text itself in rows of ``seq_len``. ``max_tokens``: the budget, all rows.
    """

    source: str = "greedy"
    prompt_tokens: int = 32
    new_tokens: int = 80
    seq_len: int = 256
    max_tokens: int = 120_000

    @property
    def row_tokens(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def span(self) -> int:
        return self.prompt_tokens * PROMPT_STRIDE


def split_rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows for the heads, and held-out rows (whole prompts, never trained on).

    Positions of one continuation share its content, so a held-out *position*
    of a trained row flatters the heads (0.5B: 71% vs 41% for new prompts).
    The held-out rows give the honest curve in the report and train CLP and
    the gate, whose labels must reflect how the heads do on unseen text.
    """
    if n < 2:
        raise ClpError("training needs at least 2 rows of features; give more text")
    order = np.random.default_rng([seed, 3]).permutation(n)
    held = max(1, round(n * HELD_SHARE))
    return np.sort(order[held:]), np.sort(order[:held])


def features_for(
    model,
    tokenizer,
    files: list[str],
    folder: Path,
    k: int,
    source: FeatureSource,
    *,
    seed: int = 0,
    split: bool = False,
):
    """Backbone features for the text ``files``, extracted once into ``folder``:
    all their positions, or (``split``) those of the training and held-out rows.

    With source "text" the held-out rows are greedy continuations of
    prompts cut from the text after the training rows: CLP and the gate
    learn there how often drafts pass, and that must be measured on what
    decoding meets (the backbone's own text is easier to draft than a
    human's), not on more teacher-forced text.
    """
    if source.source == "text":
        return _text_features(model, tokenizer, files, folder, k, source, split)
    n = max(1, source.max_tokens // source.row_tokens)
    text = tokenize_files(tokenizer, files, seq_len=source.span, max_tokens=n * source.span)
    prompts = text[:, : source.prompt_tokens]
    continue_greedily(model, prompts, folder, new_tokens=source.new_tokens)
    if not split:
        return _positions(folder, k)
    tokens, hidden, greedy_ids, start = _features(folder, k)
    rows = split_rows(tokens.shape[0], seed)
    return tuple(Positions(tokens, hidden, greedy_ids, k, start, r) for r in rows)


def _text_features(model, tokenizer, files, folder: Path, k: int, source: FeatureSource, split):
    """Source "text": the text teacher-forced, and (``split``) held-out
    greedy continuations of prompts cut from the text after it."""
    tokens = tokenize_files(tokenizer, files, seq_len=source.seq_len, max_tokens=source.max_tokens)
    extract(model, tokens, folder)
    if not split:
        return _positions(folder, k)
    span = source.span
    rows = max(2, round(HELD_SHARE * tokens.size / source.row_tokens))
    flat = tokenize_files(tokenizer, files, seq_len=1, max_tokens=tokens.size + rows * span)
    rest = flat.reshape(-1)[tokens.size :]
    if rest.size < span:
        raise ClpError(
            "no text is left after the training rows for held-out prompts; "
            "give more text or lower --max-tokens"
        )
    prompts = rest[: rest.size // span * span].reshape(-1, span)[:, : source.prompt_tokens]
    held_folder = folder.with_name(folder.name + "-held")
    continue_greedily(model, prompts, held_folder, new_tokens=source.new_tokens)
    return _positions(folder, k), _positions(held_folder, k)


def _features(folder: Path, k: int) -> tuple:
    tokens, hidden, greedy_ids, start = load_features(folder)
    if tokens.shape[1] - max(start, 0) <= k + 1:
        raise ClpError(
            f"rows of {tokens.shape[1]} tokens leave no position with {k} drafts to learn; "
            "raise --new-tokens (or --seq-len) above k + 1"
        )
    return tokens, hidden, greedy_ids, start


def _positions(folder: Path, k: int) -> Positions:
    tokens, hidden, greedy_ids, start = _features(folder, k)
    return Positions(tokens, hidden, greedy_ids, k, start)
