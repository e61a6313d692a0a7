"""The real Qwen2.5-Coder-1.5B with its shipped drafter (an MTP layer with a
copy head): found by its weights, and greedy verify, every draft fed, writes
plain decoding's tokens while some drafts are accepted."""

import pytest

import clp_mlx  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
from clp_mlx.api import load_with_drafter as load
from clp_mlx.api import stream_generate
from clp_mlx.errors import ClpError
from clp_mlx.sources.named import NAMED_MODELS, named_from_gguf

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Robert Boulter is an English film and television actor. Robert Boulter had a",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def loaded():
    name = "qwen2.5-coder-1.5b-instruct"
    try:
        folder = named_from_gguf(NAMED_MODELS[name], "float32", False, True)
    except (ClpError, OSError) as e:  # no cached copy, and offline
        pytest.skip(f"Qwen2.5-Coder-1.5B not available offline: {e}")
    return load(folder)


def test_the_shipped_drafter_has_a_copy_head_and_verify_stays_greedy(loaded):
    model, tokenizer, heads = loaded
    assert heads is not None, "the shipped drafter was not found for these weights"
    assert "pointer" in heads.mtp
    accepted = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        runs = {
            mode: list(
                stream_generate(
                    model, tokenizer, ids, heads, mode=mode, feed="all", max_tokens=MAX_TOKENS
                )
            )
            for mode in ("ar", "verify")
        }
        assert [r.token for r in runs["verify"]] == [r.token for r in runs["ar"]], prompt
        accepted += sum(n * c for n, c in enumerate(runs["verify"][-1].stats.accepted))
    assert accepted > 0
