"""A drafter's draft vocabulary grown: its own ids kept, the most frequent
tokens of some text files and distilled rows added (``convert grow-vocab``).

An MTP layer reads its drafts through the backbone's own output rows, so its
weights do not depend on which rows: a larger vocabulary drafts at once, and a
``train_mtp --init-from ... --keep-vocab`` run then teaches the layer the new
tokens. A token outside the draft vocabulary is a draft the layer can never
get right (only a copy head can), so the share of the backbone's greedy tokens
it covers bounds the accuracy; each draft depth reads every row of it, so its
size is a cost too (FastMTP and EAGLE-3 draft from 32k tokens).

Each source counts as its share of its own tokens: a text file of millions of
tokens and a few thousand distilled rows weigh the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ClpError


def token_shares(ids: np.ndarray, vocab: int) -> np.ndarray:
    """How often each token id below ``vocab`` occurs in ``ids``, as a share
    of all of them (ids the model has no rows for cannot be drafted)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    counts = np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)
    return counts / max(1, int(counts.sum()))


def grown(old, size: int, shares: list[np.ndarray]) -> np.ndarray:
    """``old``'s ids and then the ids of highest summed share (ties: lower id
    first) up to ``size`` ids, sorted."""
    score = np.sum(shares, axis=0)
    have = np.zeros(score.size, dtype=bool)
    have[np.asarray(old, dtype=np.int64)] = True
    order = np.argsort(-score, kind="stable")
    extra = order[~have[order]][: size - int(have.sum())]
    return np.sort(np.concatenate([np.flatnonzero(have), extra]))


def text_ids(path: Path, tokenizer) -> np.ndarray:
    """The token ids of a UTF-8 text file, as the backbone's tokenizer reads it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ClpError(f"cannot read --text {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ClpError(f"--text {path} is not UTF-8 text") from None
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not "longer than the model's context": it is no prompt
    try:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
    finally:
        hf_logging.set_verbosity(level)


def check_request(src, out, *, texts=(), data=(), force=False) -> None:
    """What can be refused before a backbone is loaded and tokens counted:
    no sources, or an -o that is the drafter, exists without ``force`` or
    holds anything but heads (what ``save_heads`` would refuse last)."""
    from ..model.heads_files import holds_only_heads
    from ..sources.converting import check_output

    if not texts and not data:
        raise ClpError("give --text files or --data folders to count tokens in")
    if Path(out).resolve() == Path(src).resolve():
        raise ClpError(f"-o {out} is the drafter itself: write the grown one to a new folder")
    check_output(out, force, [Path(p) for p in (src, *texts, *data)], ours=holds_only_heads)


def grow_vocab(src, model, tokenizer, out, size: int, *, texts=(), data=(), force=False) -> Path:
    """Write to ``out`` the drafter in ``src`` with a draft vocabulary of
    ``size`` ids: its own, then the most frequent of ``texts`` (files) and of
    the greedy tokens in ``data`` (distilled folders of this backbone)."""
    from ..model import backbone
    from ..model.heads_files import load_heads, save_heads
    from .mtp_data import Rows

    check_request(src, out, texts=texts, data=data, force=force)
    bundle = load_heads(src, model)  # every part checked against this backbone
    vocab = backbone.token_count(model)  # the bound load_heads checks draft ids against
    if bundle.config.design != "mtp" or "draft_vocab" not in bundle:
        raise ClpError(f"{src}: not an MTP-layer drafter with a draft vocabulary")
    old = np.array(bundle.draft_vocab)
    if not len(old) < size <= vocab:
        raise ClpError(f"--size must be above the drafter's {len(old)} ids and at most "
                       f"the vocabulary's {vocab}, got {size}")  # fmt: skip
    shares = [token_shares(text_ids(t, tokenizer), vocab) for t in texts]
    if data:
        shares.append(token_shares(Rows.for_model(list(data), model.args).greedy_tokens(), vocab))
    bundle.set_draft_vocab(grown(old, size, shares).tolist())
    made = {
        "from": "/".join(Path(src).resolve().parts[-2:]),
        "ids_before": len(old),
        "texts": [Path(t).name for t in texts],
        "data": [Path(d).name for d in data],
    }
    return save_heads(bundle, out, force=force, extra={"grown_vocab": made})
