"""Backbone features for training heads, computed once and cached on disk.

For every position t of the training text we keep the backbone's final hidden
state h_t (fp16) and its greedy prediction b_t (the token it would write at
t+1). Head i is then trained on pairs (h_t -> h_{t+i}, b_{t+i}) without
running the backbone again. Extraction is the expensive part of training, so
it writes one file pair per chunk of sequences, atomically, and a rerun skips
chunks already on disk: an interrupted extraction resumes where it stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import backbone
from .decode import greedy
from .errors import ClpError

CHUNK_SEQS = 8  # sequences per file: small enough to lose little on an interrupt


def tokenize_files(tokenizer, paths: list[str], *, seq_len: int, max_tokens: int) -> np.ndarray:
    """Concatenate the files' tokens and cut them into (n, seq_len) rows."""
    ids: list[int] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ClpError(f"training text {path} does not exist")
        text = p.read_text(encoding="utf-8", errors="replace")
        # Encode block by block (cut at line ends) so a large file costs only
        # the tokens the budget asks for.
        start = 0
        while start < len(text) and len(ids) < max_tokens:
            end = text.find("\n", start + 100_000)
            end = len(text) if end < 0 else end + 1
            ids.extend(tokenizer.encode(text[start:end]))
            start = end
        if len(ids) >= max_tokens:
            break
    n = min(len(ids), max_tokens) // seq_len
    if n == 0:
        raise ClpError(f"the text gives {len(ids)} tokens, fewer than one sequence of {seq_len}")
    return np.asarray(ids[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def extract(
    model, tokens: np.ndarray, folder: Path, *, batch: int = 4, progress: bool = True
) -> Path:
    """Write hidden states and greedy predictions for ``tokens`` into ``folder``."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    meta = {"shape": list(tokens.shape), "signature": backbone.signature(model)["fingerprint"]}
    meta_path = folder / "features.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ClpError(
            f"{folder} holds features of other text or another backbone; use a new folder"
        )
    meta_path.write_text(json.dumps(meta))
    np.save(folder / "tokens.npy", tokens)
    chunks = range(0, tokens.shape[0], CHUNK_SEQS)
    for start in tqdm(chunks, desc="backbone features", unit="chunk", disable=not progress):
        target = folder / f"chunk{start:06d}.npz"
        if target.exists():
            continue  # done by an earlier, interrupted run
        rows = tokens[start : start + CHUNK_SEQS]
        hs, bs = [], []
        for b in range(0, rows.shape[0], batch):
            h = model.model(mx.array(rows[b : b + batch]))
            g = greedy(backbone.project(model, h))
            mx.eval(h, g)
            hs.append(np.array(h.astype(mx.float16)))
            bs.append(np.array(g.astype(mx.int32)))
        tmp = target.with_suffix(".tmp.npz")
        np.savez(tmp, hidden=np.concatenate(hs), greedy=np.concatenate(bs))
        os.replace(tmp, target)
    return folder


def load_features(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, hidden fp16, greedy) for every sequence, as (n, L[, d]) arrays."""
    meta_path = folder / "features.json"
    if not meta_path.exists():
        raise ClpError(f"{folder} holds no features (features.json is missing)")
    tokens = np.load(folder / "tokens.npy")
    files = sorted(folder.glob("chunk*.npz"))
    files = [f for f in files if not f.name.endswith(".tmp.npz")]
    if len(files) * CHUNK_SEQS < tokens.shape[0]:
        raise ClpError(f"{folder}: feature extraction is incomplete; run it again to resume")
    parts = [np.load(f) for f in files]
    hidden = np.concatenate([p["hidden"] for p in parts])
    greedy_ids = np.concatenate([p["greedy"] for p in parts])
    return tokens, hidden, greedy_ids
