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
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..decode.sampling import greedy
from ..errors import ClpError
from ..model import backbone
from ..paths import atomic_file, write_text

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
    _check_meta(folder, _with_quantization(meta, model))
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
        _save_chunk(target, np.concatenate(hs), np.concatenate(bs))
    return folder


def continue_greedily(
    model,
    prompts: np.ndarray,
    folder: Path,
    *,
    new_tokens: int,
    batch: int = 64,
    progress: bool = True,
) -> Path:
    """Features of the backbone's own greedy continuations of ``prompts``.

    At decode time a head sees the backbone's own text, where token t+1 *is*
    the backbone's greedy choice. On human text it is not (the 0.5B's greedy
    token matches WikiText's next token ~40% of the time), so a teacher-forced
    label b_{t+2} is conditioned on a token the head never sees. Continuing
    each prompt greedily gives rows where the text and the backbone agree at
    every generated position: the labels are exactly what greedy decoding
    (and so verify) will produce. The prompts are fed together as one batch of
    equal-length rows; rows of a batch are written as one resumable chunk.
    """
    from mlx_lm.models.cache import make_prompt_cache
    from tqdm import tqdm

    n, p_len = prompts.shape
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "shape": [n, p_len + new_tokens],
        "start": p_len - 1,  # first position whose futures are all generated
        "signature": backbone.signature(model)["fingerprint"],
    }
    _check_meta(folder, _with_quantization(meta, model))
    tokens_path = folder / "tokens.npy"
    tokens = np.load(tokens_path) if tokens_path.exists() else np.zeros(meta["shape"], np.int32)
    tokens[:, :p_len] = prompts
    for start in tqdm(
        range(0, n, batch), desc="greedy continuations", unit="batch", disable=not progress
    ):
        target = folder / f"chunk{start:06d}.npz"
        if target.exists():
            continue
        rows = mx.array(prompts[start : start + batch])
        cache = make_prompt_cache(model)
        h = model.model(rows, cache=cache)
        hs, gs = [h], [greedy(backbone.project(model, h))]
        for _ in range(new_tokens):  # the last pass: the last token's hidden state
            h = model.model(gs[-1][:, -1:], cache=cache)
            hs.append(h)
            gs.append(greedy(backbone.project(model, h)))
            mx.eval(gs[-1])
        h, g = mx.concatenate(hs, axis=1), mx.concatenate(gs, axis=1)
        mx.eval(h, g)
        g = np.array(g.astype(mx.int32))
        tokens[start : start + batch, p_len:] = g[:, p_len - 1 : -1]
        with atomic_file(tokens_path) as tmp, open(tmp, "wb") as f:
            np.save(f, tokens)  # before the chunk: a chunk on disk always has its tokens
        _save_chunk(target, np.array(h.astype(mx.float16)), g)
    return folder


def _with_quantization(meta: dict, model) -> dict:
    """A quantized backbone's features are its own: its greedy tokens differ
    from the float weights' even where the weight probe matches. (Float
    backbones' records stay as they were, so their work folders still resume.)"""
    quantized = backbone.quantization(model)
    return {**meta, "quantization": quantized} if quantized else meta


def _check_meta(folder: Path, meta: dict) -> None:
    meta_path = folder / "features.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise ClpError(
            f"{folder} holds features of other text or another backbone; use a new folder"
        )
    write_text(meta_path, json.dumps(meta))


def _save_chunk(target: Path, hidden: np.ndarray, greedy_ids: np.ndarray) -> None:
    with atomic_file(target) as tmp, open(tmp, "wb") as f:
        np.savez(f, hidden=hidden, greedy=greedy_ids)  # a file: a name would gain ".npz"


def load_features(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(tokens, hidden fp16, greedy) for every sequence, as (n, L[, d]) arrays,
    and the first position worth training on (0, or the end of the prompt)."""
    meta_path = folder / "features.json"
    if not meta_path.exists():
        raise ClpError(f"{folder} holds no features (features.json is missing)")
    tokens = np.load(folder / "tokens.npy")
    files = sorted(folder.glob("chunk*.npz"))  # partial chunks are hidden (".chunk...")
    parts = [np.load(f) for f in files if not f.name.endswith(".tmp.npz")]  # older versions'
    if sum(p["greedy"].shape[0] for p in parts) < tokens.shape[0]:
        raise ClpError(f"{folder}: feature extraction is incomplete; run it again to resume")
    hidden = np.concatenate([p["hidden"] for p in parts])
    greedy_ids = np.concatenate([p["greedy"] for p in parts])
    return tokens, hidden, greedy_ids, json.loads(meta_path.read_text()).get("start", 0)
