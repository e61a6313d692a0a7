"""Row padding: the same numbers from a padded pass, and only where it is wanted."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import decode_pairs, random_heads, tiny_model
from mlx_lm.models.cache import make_prompt_cache

from clp_mlx.native import NativeStatus, padrows
from clp_mlx.model.backbone import hidden_states, project


def logits_of(model, tokens):
    return project(model, hidden_states(model, mx.array(tokens), make_prompt_cache(model)))


@pytest.mark.parametrize("tied", [True, False])
def test_a_padded_model_computes_the_same_logits(tied):
    model = tiny_model(seed=3, tied=tied)
    tokens = list(range(5, 25))
    plain = {n: np.array(logits_of(model, tokens[:n])) for n in (1, 2, 3, 4, 15, 16, 20)}
    assert padrows.pad_rows(model, force=True) and padrows.is_padded(model)
    padded_output = (
        isinstance(model.model.embed_tokens, padrows.PaddedEmbedding)
        if tied
        else isinstance(model.lm_head, padrows.PaddedLinear)
    )
    assert padded_output
    for n, want in plain.items():
        got = np.array(logits_of(model, tokens[:n]))
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_padding_only_touches_three_to_fifteen_rows():
    calls = []
    layer = padrows.PaddedLinear(8, 4)
    for m in (1, 2, 3, 15, 16, 40):
        calls.append(layer(mx.ones((1, m, 8))).shape)
    assert calls == [(1, m, 4) for m in (1, 2, 3, 15, 16, 40)]
    wide = []
    original = nn.Linear.__call__
    try:
        nn.Linear.__call__ = lambda self, x: wide.append(x.shape[-2]) or original(self, x)
        for m in (1, 2, 3, 15, 16, 40):
            layer(mx.ones((1, m, 8)))
    finally:
        nn.Linear.__call__ = original
    assert wide == [1, 2, 16, 16, 16, 40]


def test_verify_on_a_padded_model_is_still_greedy_decoding():
    model = tiny_model(seed=4)
    heads = random_heads(model, 3, seed=1, scale=0.3)
    prompt = [3, 9, 27, 81]
    ar = [t for t, _ in decode_pairs(prompt, model, heads, mode="ar", max_tokens=24)]
    padrows.pad_rows(model, force=True)
    verify = [t for t, _ in decode_pairs(prompt, model, heads, mode="verify", max_tokens=24)]
    assert verify == ar


def _native(monkeypatch, loaded: bool, few_rows: bool) -> None:
    """Make padrows see this BLAS and kernel, whatever this process loaded."""
    state = NativeStatus(blas="openblas" if loaded else None, few_rows=few_rows, note="")
    monkeypatch.setattr(padrows, "status", lambda: state)


def test_padding_is_off_when_asked_and_off_the_fp32_path(monkeypatch):
    model = tiny_model(seed=5)
    _native(monkeypatch, loaded=True, few_rows=False)
    monkeypatch.setattr(padrows.mx, "default_device", lambda: mx.cpu)
    assert padrows.wanted(model)
    _native(monkeypatch, loaded=True, few_rows=True)  # 4 rows cost less than 16 there
    assert not padrows.wanted(model)
    _native(monkeypatch, loaded=True, few_rows=False)
    monkeypatch.setenv("CLP_MLX_PAD_ROWS", "0")
    assert not padrows.pad_rows(model) and not padrows.is_padded(model)
    monkeypatch.delenv("CLP_MLX_PAD_ROWS")
    model.set_dtype(mx.float16)
    assert not padrows.wanted(model)
    _native(monkeypatch, loaded=False, few_rows=False)
    assert not padrows.wanted(tiny_model(seed=5))


def test_quantized_layers_are_left_alone():
    model = tiny_model(seed=6, hidden=64)
    nn.quantize(model, group_size=32, bits=4)
    padrows.pad_rows(model, force=True)
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.QuantizedLinear in kinds and padrows.PaddedLinear not in kinds


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS is preloaded on Linux only")
def test_importing_mlx_first_warns_that_openblas_is_lost():
    env = {k: v for k, v in os.environ.items() if k != "CLP_MLX_NO_OPENBLAS"}

    def warned(code):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return "Import clp_mlx first" in done.stderr

    assert warned("import mlx.core; import clp_mlx")
    assert not warned("import clp_mlx; import mlx.core")
