"""What the hostile case builders share: the valid inputs, and the helpers that
copy (hard-link) them into a case and corrupt the copy."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from hostile_inputs import Batch, Case
from hypothesis import strategies as st

GEN, CHAT, CONVERT = "clp_mlx.generate", "clp_mlx.chat", "clp_mlx.cli.convert"
TRAIN, BENCH = "clp_mlx.train", "clp_mlx.bench"
STEP, DISTILL = "clp_mlx.cli.bench_step", "clp_mlx.cli.distill"
SERVER, TRAIN_MTP = "clp_mlx.server", "clp_mlx.cli.train_mtp"
VOCAB = 128  # the tiny model's embedding rows
# fmt: off
TINY_TRAIN = ["--steps", "2", "--batch", "2", "--max-tokens", "96", "--prompt-tokens", "4",
              "--new-tokens", "4", "--decision-steps", "2", "--draft-vocab", "16", "--k", "2"]
# fmt: on
WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing of rivers and stone"
TEXT = "".join(  # WikiText-shaped, every paragraph different
    f" = Article {i} = \n\n "
    + " ".join(WORDS.split()[(i * j + j * j) % 18] for j in range(60))
    + " . \n\n"
    for i in range(1, 25)
)


@dataclass
class Inputs:
    """Valid inputs, made once: each case hard-links them and corrupts its copy."""

    model: Path  # MLX folder of conftest's tiny_model(0), vocabulary 128
    heads: Path  # chain heads for it, k=2, random weights, a 32-token draft vocabulary
    chat_model: Path  # MLX folder with a chat template (tests/test_chat.py)
    gguf: Path  # tiny Qwen2 GGUF (tests/gguf_fixtures.py)
    hf: Path  # tiny Hugging Face folder, safetensors (tests/test_hf_convert.py)
    torch_heads: Path  # Medusa head checkpoint for `model` (tests/test_torch_heads.py)
    text: Path  # a little English text, for train/bench/distill
    distilled: Path  # `model`'s self-distilled rows of `text`, some held out


def make_inputs(folder: Path) -> Inputs:
    """The valid inputs every case starts from, made the way the other tests make them."""
    from conftest import random_heads, tiny_model, write_model_folder
    from gguf_fixtures import write_tiny_gguf
    from test_chat import write_chat_model
    from test_hf_convert import make_hf_folder
    from test_torch_heads import medusa_state

    from clp_mlx.cli.distill import main as distill
    from clp_mlx.model.heads_files import save_heads
    from clp_mlx.sources.torch_zip import save_torch_file

    model = tiny_model(0)
    for name in ("model", "chat-model"):
        (folder / name).mkdir(parents=True)
    write_model_folder(folder / "model", model)
    heads = random_heads(model, 2, seed=1, scale=0.1, design="chain")
    heads.set_draft_vocab(list(range(0, 128, 4)))
    save_heads(heads, folder / "heads")
    write_chat_model(folder / "chat-model")
    write_tiny_gguf(folder / "x.gguf")
    make_hf_folder(folder / "hf")
    proj = np.array(model.model.embed_tokens.weight)
    save_torch_file(folder / "x.pt", medusa_state(2, proj=proj))
    put(folder / "text.txt", TEXT)
    distill(["--model", str(folder / "model"), "--out", str(folder / "distilled"), "--kind",
             "wikitext", "--data", str(folder / "text.txt"), "--prompts", "8", "--prompt-tokens",
             "4", "--new-tokens", "6", "--batch", "4", "--shard-size", "4", "--heldout", "0.25",
             "--quiet"])  # fmt: skip
    names = ("model", "heads", "chat-model", "x.gguf", "hf", "x.pt", "text.txt", "distilled")
    return Inputs(*(folder / name for name in names))


def put(path: Path, data) -> Path:
    """Replace ``path`` (never write through a hard link into a shared input)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else str(data).encode())
    return path


def link(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=os.link)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
    return dst


def save_st(path: Path, arrays: dict) -> None:
    path.unlink(missing_ok=True)
    mx.save_safetensors(str(path), arrays)


def edit_json(path: Path, **changes) -> None:
    meta = json.loads(path.read_text())
    meta.update(changes)
    put(path, json.dumps(meta))


def truncate(path: Path, size: int) -> None:
    put(path, path.read_bytes()[:size])


def flip(path: Path, edits) -> None:
    data = bytearray(path.read_bytes())
    for pos, value in edits:
        data[pos % len(data)] = value
    put(path, bytes(data))


def header_end(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def byte_flips(low: int, high: int):
    """One to three (position in [low, high], new byte) edits, for :func:`flip`."""
    return st.lists(st.tuples(st.integers(low, high), st.integers(0, 255)), min_size=1, max_size=3)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=4,
)


def gen(c: Case, model, *extra, **kw) -> Case:
    """``generate`` on ``model`` with a short prompt, initial heads and ``extra`` flags."""
    return c.cli(GEN, "--model", model, "--heads", "init", "-p", "hello", "-m", "2", *extra, **kw)


def hf_folder_case(batch: Batch, s: Inputs, name: str, change, cls="3", via=CONVERT) -> Case:
    """A Hugging Face folder changed by ``change(case, folder)``, converted or generated from."""
    c = batch.new(name, cls)
    src = link(s.hf, c.inp / "src")
    change(c, src)
    if via == CONVERT:
        return c.cli(CONVERT, "hf", src, "-o", c.inp / "out")
    return gen(c, src)
