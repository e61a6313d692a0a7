"""A tiny model and its self-distilled data, for the MTP-layer tests."""

import mlx.core as mx
import numpy as np
from conftest import tiny_model, write_model_folder

from clp_mlx.cli.distill import main as distill
from clp_mlx.cli.train_mtp import main as train_mtp
from clp_mlx.model.heads_files import init_heads


def attending_layer():
    """A tiny model and a 3-depth MTP layer whose attention matters (random
    residual branches, where a new layer's are zero)."""
    model = tiny_model(0)
    bundle = init_heads(model, 3, design="mtp", gate=False, head0=False, seed=1)
    mx.random.seed(7)
    o = bundle.mtp.block.self_attn.o_proj
    o.weight = mx.random.normal(o.weight.shape) * 0.3
    return model, bundle


WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def distilled(root):
    """``root/tiny`` (a model folder) and ``root/data`` (its distilled rows)."""
    write_model_folder(root / "tiny", tiny_model(0))
    rng = np.random.default_rng(0)
    lines = [" " + " ".join(rng.choice(WORDS, rng.integers(6, 30))) + " ." for _ in range(60)]
    (root / "wiki.txt").write_text("\n".join(lines) + "\n")
    argv = ["--model", str(root / "tiny"), "--out", str(root / "data"), "--kind", "wikitext",
            "--data", str(root / "wiki.txt"), "--prompts", "24", "--prompt-tokens", "6",
            "--new-tokens", "16", "--batch", "4", "--shard-size", "8", "--heldout", "0.2",
            "--quiet"]  # fmt: skip
    assert distill(argv) == 0
    return root


def train_argv(root, out, *extra, steps: int = 6):
    """train_mtp's flags for a short 2-depth run on :func:`distilled`'s rows into ``root/out``."""
    return ["--model", str(root / "tiny"), "--data", str(root / "data"), "--out", str(root / out),
            "--steps", str(steps), "--batch", "3", "--depths", "2", "--mlp-size", "32",
            "--draft-vocab", "64", "--warmup", "2", "--checkpoint-every", "2", "--quiet",
            *extra]  # fmt: skip


def trained(root, steps: int = 30):
    """:func:`distilled`, and ``root/m/drafter``: a 2-depth layer trained on its rows."""
    distilled(root)
    argv = ["--model", str(root / "tiny"), "--data", str(root / "data"), "--out", str(root / "m"),
            "--steps", str(steps), "--batch", "4", "--depths", "2", "--mlp-size", "32",
            "--lr", "3e-3", "--draft-vocab", "64", "--warmup", "2", "--quiet"]  # fmt: skip
    assert train_mtp(argv) == 0
    return root
