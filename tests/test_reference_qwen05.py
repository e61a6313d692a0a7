"""The converted Qwen2.5-Coder-0.5B against a reference made by transformers.

tests/data/make_reference.py made the reference with transformers and torch
from the same official GGUF file, without clp_mlx or MLX (see
tests/data/README.md). Both sides run in fp32 from the same dequantized
weights, so the greedy tokens must be the same and the logits may differ only
by rounding.
"""

import json
from pathlib import Path

import pytest
from conftest import decode_pairs

import clp_mlx  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import numpy as np

from clp_mlx.model.backbone import load_backbone
from clp_mlx.errors import ClpError
from clp_mlx.sources.named import NAMED_MODELS, named_from_gguf

pytestmark = pytest.mark.slow

REFERENCE = json.loads(
    (Path(__file__).parent / "data" / "reference_qwen2.5-coder-0.5b.json").read_text()
)
PROMPTS = REFERENCE["prompts"]

# Measured against the reference (torch 2.13, CPU) on MLX's CPU backend, with
# OpenBLAS and with MLX's bundled BLAS: over the 18 positions the largest
# difference was 2.9e-5 on the top-20 logits and 2.6e-5 on the logsumexps,
# including up to 5e-6 from storing the values to 5 decimals; the top-20 ids
# came out in the same order. 5e-4 leaves a margin of over 15x for other
# backends' summation order. A wrong or misplaced tensor moves logits by 0.1
# or more.
LOGIT_TOL = 5e-4


@pytest.fixture(scope="module")
def backbone():
    try:  # the GGUF's weights, as the reference (not the safetensors the name may fetch)
        path = named_from_gguf(NAMED_MODELS["qwen2.5-coder-0.5b-instruct"], "float32", True, None)
    except (ClpError, OSError) as e:  # no cached copy and no network
        pytest.skip(f"Qwen2.5-Coder-0.5B not available: {e}")
    return load_backbone(path, "float32")


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_greedy_tokens_match(backbone, prompt):
    model, _ = backbone
    ref = prompt["greedy"]
    got = [t for t, _ in decode_pairs(prompt["ids"], model, None, mode="ar", max_tokens=len(ref))]
    if got != ref:
        k = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        pytest.fail(f"first difference at step {k}: {got[k]} != {ref[k]} "
                    f"(reference top-2 gap there: {prompt['margins'][k]})\n{got}\n{ref}")


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p["name"] for p in PROMPTS])
def test_logits_match(backbone, prompt):
    model, _ = backbone
    ids, greedy = prompt["ids"], prompt["greedy"]
    # One pass without a cache, teacher-forced on the reference's greedy tokens,
    # as the reference did.
    logits = np.array(model(mx.array([ids + greedy[:-1]]))[0].astype(mx.float32))
    for pos in prompt["positions"]:
        row = logits[len(ids) - 1 + pos["offset"]]
        ref_ids, ref_vals = pos["top_ids"], np.array(pos["top_logits"])
        ours_ids = np.argsort(-row)[: len(ref_ids)]
        where = f"{prompt['name']} offset {pos['offset']}"
        np.testing.assert_allclose(row[ref_ids], ref_vals, rtol=0, atol=LOGIT_TOL, err_msg=where)
        # Rank by rank, the ids must agree, unless two values tie within
        # the tolerance and the ids swap places: then the value at that rank
        # still agrees.
        np.testing.assert_allclose(row[ours_ids], ref_vals, rtol=0, atol=LOGIT_TOL, err_msg=where)
        assert ours_ids[0] == ref_ids[0], where
        # In float64: mx.logsumexp over 152k fp32 values is itself off by up to
        # 6e-4 on the CPU backend, and it is the logits that are under test.
        lse = float(np.logaddexp.reduce(row.astype(np.float64)))
        assert abs(lse - pos["logsumexp"]) <= LOGIT_TOL, (where, lse, pos["logsumexp"])


def test_tokenizer_ids_match(backbone):
    _, tokenizer = backbone
    texts = [(p["text"], p["ids"]) for p in PROMPTS]
    texts += [(e["text"], e["ids"]) for e in REFERENCE["tokens"]]
    ours = [tokenizer.encode(text) for text, _ in texts]
    wrong = [(text, ids, o) for (text, ids), o in zip(texts, ours) if o != ids]
    assert not wrong, "\n".join(f"{t!r}\n  reference {r}\n  ours      {o}" for t, r, o in wrong)


def test_tokenizer_decode_round_trips(backbone):
    _, tokenizer = backbone
    # Only where the reference's own decode gives the text back (NFD text,
    # for one, comes back in NFC form).
    entries = [e for e in REFERENCE["tokens"] if e["roundtrip"]]
    decoded = [(e["text"], tokenizer.decode(e["ids"])) for e in entries]
    wrong = [(text, d) for text, d in decoded if d != text]
    assert not wrong, "\n".join(f"{t!r} -> {d!r}" for t, d in wrong)
