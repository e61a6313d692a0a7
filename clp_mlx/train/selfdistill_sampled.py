"""Openings the backbone writes itself: raw text sampled from a start text.

The raw-text sibling of Magpie prompts (:mod:`.selfdistill_magpie`). From a
start text the user gives (``--start``; for encyclopedia-like text, e.g.
``"From Wikipedia, the free encyclopedia\\n\\n"``), the model samples an
opening (temperature 1, top-p 0.95 among the top 1024 tokens, up to ``cap``
tokens or a special token), and the row is its greedy continuation of start
plus opening. Each opening brings its own topic, names and numbers, so rows
are not bound to the articles of one corpus, which a drafter trained on that
corpus's openings learns by heart. No chat template is needed: base models
work too.

Keys and redraws are magpie's (per prompt index and attempt, under their own
salt); the prompt is the start's token ids followed by the sampled ids, as
drawn (not decoded and encoded again).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from ..errors import ClpError
from .selfdistill_magpie import ATTEMPTS, TEMPERATURE, TOP_K, TOP_P, draw_prompts, stop_ids

SALT = "sampled"


def start_ids(tokenizer, start: str) -> list[int]:
    ids = tokenizer.encode(start, add_special_tokens=False)
    if not ids:
        raise ClpError("--start must hold some text: every opening is sampled after it")
    return list(ids)


def inputs_digest(tokenizer, start: str) -> str:
    """What sampled openings are made from: the start's ids and the sampling rule."""
    what = [SALT, start_ids(tokenizer, start), TEMPERATURE, TOP_P, TOP_K, ATTEMPTS]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def sampled_prompts(
    model, tokenizer, indices, *, start: str, cap: int, batch: int, seed: int
) -> list[tuple[int, np.ndarray]]:
    """(index, start + sampled opening) for the prompt ``indices`` of one shard, in
    order; an index whose every draw was empty or a repeat has none."""
    prefix = start_ids(tokenizer, start)
    chosen = draw_prompts(
        model, indices, prefix, stop_ids(tokenizer), cap=cap, batch=batch, seed=seed,
        salt=SALT, norm=tuple,
    )  # fmt: skip
    return [(i, np.asarray(prefix + list(chosen[i]), dtype=np.int32)) for i in sorted(chosen)]
