"""Quantized (4-bit, 8-bit) and half-precision (fp16, bf16) backbones.

Tiny random Qwen2 models, quantized with ``mlx.nn.quantize`` as
``mlx_lm.convert -q`` does: every mode runs, greedy verify equals ar token
for token, heads made on one precision run on another, training works on a
quantized backbone. The slow test at the end checks the real 0.5B at 4 and 8
bits against mlx-lm's own generation on the same folder.
"""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import decode_pairs, random_heads, tiny_model, write_model_folder

from clp_mlx.decode.sampling import Sampling
from clp_mlx.model import backbone
from clp_mlx.model.heads_files import load_heads, save_heads

# (bits, group size) or a float dtype; the tiny dims (64, 128) are multiples of both groups.
PRECISIONS = {"q4": (4, 32), "q8": (8, 64), "f16": mx.float16, "bf16": mx.bfloat16}


def tiny_as(kind: str, seed: int = 0, tied: bool = True):
    """The tiny model of ``seed`` (the same weights each call) in precision ``kind``."""
    model = tiny_model(seed, tied=tied)
    if kind in PRECISIONS:
        how = PRECISIONS[kind]
        if isinstance(how, tuple):
            nn.quantize(model, group_size=how[1], bits=how[0])
        else:
            model.set_dtype(how)
        mx.eval(model.parameters())
    return model


def tokens(prompt, model, heads=None, **kw):
    return [t for t, _ in decode_pairs(prompt, model, heads, **kw)]


def prompt_of(n, seed):
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


def test_the_tiny_copies_are_what_they_say():
    q4, q8 = tiny_as("q4", tied=False), tiny_as("q8", tied=False)
    assert backbone.quantization(q4) == "4-bit/32" and backbone.quantization(q8) == "8-bit/64"
    assert backbone.is_quantized_output(q4) and backbone.quantization(tiny_as("bf16")) == ""
    assert backbone.output_dtype(tiny_as("f16")) == mx.float16
    # 4 bits move the greedy path away from the fp32 one: the copies are really quantized.
    prompt = prompt_of(4, 0)
    assert tokens(prompt, q4, mode="ar", max_tokens=40) != tokens(
        prompt, tiny_model(0, tied=False), mode="ar", max_tokens=40
    )


# (design, feed, tree): every design, feed and chain/tree shape, without the whole product.
VERIFY_SETUPS = [
    ("medusa", "all", 0), ("embed", "all", 8), ("chain", "all", 8),
    ("chain", "cost", 0), ("embed", "clp", 0), ("medusa", "clp", 8),
]  # fmt: skip


@pytest.mark.parametrize("kind", list(PRECISIONS))
@pytest.mark.parametrize("tied", [True, False])
def test_greedy_verify_equals_ar_in_every_feed(kind, tied):
    seed = int(tied)
    model = tiny_as(kind, seed, tied)
    for n in (1, 7):
        prompt = prompt_of(n, seed * 10 + n)
        ar = tokens(prompt, model, mode="ar", max_tokens=32)
        for k, (design, feed, tree) in enumerate(VERIFY_SETUPS):
            heads = random_heads(model, 2 + k % 3, seed=seed + n + k, scale=0.5, design=design)
            got = tokens(prompt, model, heads, mode="verify", max_tokens=32, feed=feed, tree=tree)
            assert got == ar, (kind, n, design, feed, tree)


def test_a_bf16_near_tie_resolves_as_ar():
    # Found by a sweep: at token 16 the two best bf16 logits are 1.375 (id 64)
    # and 1.3671875 (id 69); minus logsumexp, rounded to bf16, they are one
    # value, which ar (and mlx-lm) give to the lower id; so does verify's check.
    model = tiny_as("bf16", 3, tied=False)
    ar = tokens([8], model, mode="ar", max_tokens=20)
    assert ar[15:17] == [68, 64]  # 64: the tie's lower id
    heads = random_heads(model, 2, seed=4, scale=0.5)
    assert tokens([8], model, heads, mode="verify", max_tokens=20) == ar


@pytest.mark.parametrize("kind", list(PRECISIONS))
def test_every_mode_runs(kind):
    model = tiny_as(kind, 2, tied=kind != "q8")
    heads = random_heads(model, 3, seed=5, scale=0.5, design="chain")
    heads.set_draft_vocab(list(range(0, 128, 3)))
    prompt = prompt_of(5, 2)
    for mode in ("clp", "fixed", "gate", "prior-mtp"):
        got = tokens(prompt, model, heads, mode=mode, max_tokens=24)
        assert len(got) == 24 and all(0 <= t < 128 for t in got), (kind, mode)
    sampled = dict(mode="verify", max_tokens=24, sampling=Sampling(temp=0.8, top_p=0.95, seed=3))
    once = tokens(prompt, model, heads, **sampled)
    assert len(once) == 24 and once == tokens(prompt, model, heads, **sampled)


@pytest.mark.parametrize("kind", list(PRECISIONS))
def test_heads_made_on_fp32_run_on_another_precision(kind, tmp_path):
    fp32 = tiny_model(1, tied=False)
    heads = random_heads(fp32, 3, seed=2, scale=0.5, design="embed")
    vocab = list(range(1, 128, 4))
    heads.set_draft_vocab(vocab)
    save_heads(heads, tmp_path / "heads")
    model = tiny_as(kind, 1, tied=False)
    prompt = prompt_of(6, 1)
    ar = tokens(prompt, model, mode="ar", max_tokens=32)
    # The fp32 bundle as it is, and as loaded for this backbone (cast to its dtype).
    loaded = load_heads(tmp_path / "heads", model)
    want = backbone.output_dtype(model)
    assert loaded.heads[0].fuse.weight.dtype == want
    for name, bundle in (("as made", heads), ("loaded", loaded)):
        got = tokens(prompt, model, bundle, mode="verify", max_tokens=32)
        assert got == ar, (kind, name)
        assert len(tokens(prompt, model, bundle, mode="clp", max_tokens=32)) == 32
    h = backbone.hidden_states(model, mx.array(prompt), None)[-2:]
    b = mx.array([3, 9])
    # Drafts come from the draft vocabulary, through this backbone's rows of it
    # (a quantized one's dequantized), not the fp32 rows the bundle saw first.
    heads.draft(fp32, h.astype(mx.float32), b)
    drafts, _ = heads.draft(model, h, b)
    assert set(np.array(drafts).reshape(-1).tolist()) <= set(vocab)
    out = heads.draft_hidden(h, backbone.embed(model, b))
    logits = backbone.project(model, out)
    assert logits.dtype == want  # the head rows are cast, never the output weight
    scores, ids = heads._draft_scores(model, out)
    close = dict(atol=0.05, rtol=0.02) if want == mx.float32 else dict(atol=0.3, rtol=0.05)
    assert mx.allclose(scores.astype(mx.float32), logits[..., ids].astype(mx.float32), **close)
    if kind.startswith("q"):
        assert not mx.allclose(scores, heads._draft_scores(fp32, out)[0], atol=1e-3).item()


def test_output_rows_of_a_quantized_layer_are_its_dequantized_rows():
    tied, untied = tiny_as("q4", 0, tied=True), tiny_as("q8", 0, tied=False)
    ids = mx.array([0, 5, 127])
    # A tied layer's rows are its embedding lookups, value for value.
    assert mx.array_equal(backbone.output_rows(tied, ids), backbone.embed(tied, ids))
    layer = untied.lm_head
    whole = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    assert mx.array_equal(backbone.output_rows(untied, ids), whole[ids])
    assert mx.array_equal(backbone.output_rows(untied), whole)  # None: every row
    # and they are the layer's: its matmul gives the same logits, up to rounding.
    h = mx.random.normal((2, 64), key=mx.random.key(0))
    assert mx.allclose(backbone.project(untied, h), h @ whole.T, atol=1e-3, rtol=1e-4)


def quantized_folder(folder, bits=4, group_size=32):
    """An mlx-lm folder of the tiny model quantized as ``mlx_lm.convert -q`` writes it."""
    model = tiny_as(f"q{bits}", 0, tied=False)
    write_model_folder(folder, model)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_training_runs_on_a_quantized_backbone(tmp_path):
    from clp_mlx.cli.train import main

    folder = quantized_folder(tmp_path / "q4")
    text = tmp_path / "text.txt"
    words = ["alpha ", "beta ", "gamma ", "delta\n", "the cat sat "]
    text.write_text("".join(np.random.default_rng(0).choice(words, 800)))
    out = tmp_path / "heads"
    main(
        ["--model", str(folder), "--data", str(text), "--out", str(out), "--k", "2",
         "--steps", "4", "--batch", "16", "--seq-len", "32", "--max-tokens", "1024",
         "--draft-vocab", "32", "--checkpoint-every", "2", "--decision-steps", "3"]
    )  # fmt: skip
    report = json.loads((out / "training.json").read_text())
    assert [h["step"] for h in report["history"]] == [2, 4]
    model, _ = backbone.load_backbone(folder, "float32")
    assert backbone.quantization(model) == "4-bit/32"
    heads = load_heads(out, model)
    assert heads.config.draft_vocab == 32
    prompt = prompt_of(5, 3)
    ar = tokens(prompt, model, mode="ar", max_tokens=24)
    assert tokens(prompt, model, heads, mode="verify", max_tokens=24) == ar


def test_pass_costs_are_kept_apart_for_each_quantization():
    from clp_mlx.decode import feed

    keys = {feed._setup_key(tiny_as(kind, 0)) for kind in ("fp32", "q4", "q8")}
    # The copies share the weights' fingerprint, yet their passes cost differently.
    assert len(keys) == 3
    assert feed._setup_key(tiny_as("fp32", 0)) == feed._setup_key(tiny_model(0))
