"""A tiny model and its self-distilled data, for the MTP-layer tests."""

import numpy as np
from conftest import tiny_model, write_model_folder

from clp_mlx.cli.distill import main as distill

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
