"""The MTP layer's training form (all depths at once) computes what decoding
computes one step at a time, for every anchor and depth."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

from clp_mlx.model.mtp_layer import MTPLayer

DEPTHS, LENGTH = 3, 9


@pytest.fixture(scope="module")
def setup():
    model = tiny_model(0)
    mx.random.seed(3)
    layer = MTPLayer(model.args, mlp_size=48)
    h = mx.random.normal((1, LENGTH, model.args.hidden_size)) * 3
    tokens = mx.random.randint(0, 128, (1, LENGTH + DEPTHS))
    embed = model.model.embed_tokens
    return layer, h, tokens, embed, model.model.norm


def test_unrolled_equals_step_by_step_decoding(setup):
    layer, h, tokens, embed, norm = setup
    outs = layer.unrolled(h, lambda j: embed(tokens[:, j : j + LENGTH]), DEPTHS, norm)
    for s in range(LENGTH):
        x = layer.fuse(h[:, : s + 1], embed(tokens[:, 1 : s + 2]))
        g, past = layer.step(x, 0, None)  # depth 1 for anchors 0..s: the committed keys
        feature = g[:, -1:]
        np.testing.assert_allclose(feature[0, 0], outs[0][0, s], rtol=1e-4, atol=1e-4)
        for j in range(2, DEPTHS + 1):
            x = layer.fuse(norm(feature), embed(tokens[:, s + j : s + j + 1]))
            feature, past = layer.step(x, s + j - 1, past)
            np.testing.assert_allclose(feature[0, 0], outs[j - 1][0, s], rtol=1e-4, atol=1e-4)


def test_outputs_from_a_later_anchor_are_the_same_outputs(setup):
    """``first``: the prompt's anchors give keys only; every later output is unchanged."""
    layer, h, tokens, embed, norm = setup
    emb = lambda j: embed(tokens[:, j : j + LENGTH])
    for drafted in (None, lambda g: embed(mx.argmax(g, axis=-1) % 128)):
        whole = layer.unrolled(h, emb, DEPTHS, norm, drafted=drafted)
        cut = layer.unrolled(h, emb, DEPTHS, norm, drafted=drafted, first=4)
        for a, b in zip(whole, cut):
            assert b.shape[1] == LENGTH - 4
            np.testing.assert_allclose(a[:, 4:], b, rtol=1e-5, atol=1e-5)


def test_a_later_anchor_never_changes_an_earlier_one(setup):
    layer, h, tokens, embed, norm = setup
    outs = layer.unrolled(h, lambda j: embed(tokens[:, j : j + LENGTH]), DEPTHS, norm)
    h2 = mx.concatenate([h[:, :4], h[:, 4:] * -1.0], axis=1)
    outs2 = layer.unrolled(h2, lambda j: embed(tokens[:, j : j + LENGTH]), DEPTHS, norm)
    for a, b in zip(outs, outs2):
        np.testing.assert_allclose(a[0, :4], b[0, :4], rtol=1e-5, atol=1e-5)
        assert not np.allclose(a[0, 4:], b[0, 4:])


def test_a_fresh_layer_drafts_what_the_backbone_chose():
    model = tiny_model(0)
    layer = MTPLayer(model.args, mlp_size=48)
    layer.start_as_backbone(model.model.norm)
    tokens = mx.array([[5, 9, 17, 3, 77, 41]])
    h = model.model(tokens)  # final-norm hidden states
    (g,) = layer.unrolled(h, lambda j: model.model.embed_tokens(tokens), 1, model.model.norm)
    np.testing.assert_allclose(model.model.norm(g), h, rtol=1e-3, atol=1e-3)


def test_a_widened_layer_computes_what_the_narrow_one_did(setup):
    """--init-from a narrower MLP (train/mtp_start.widened): the new units add
    nothing at the start, and their gate and up rows are not zero (they learn)."""
    from mlx.utils import tree_flatten, tree_map

    from clp_mlx.train.mtp_start import widened

    _, h, tokens, embed, norm = setup
    model = tiny_model(0)
    mx.random.seed(4)
    narrow = MTPLayer(model.args, mlp_size=48)
    for side in (narrow.block.mlp.down_proj, narrow.block.self_attn.o_proj):  # not zero, so
        side.weight = mx.random.normal(side.weight.shape) * 0.1  # the MLP's output counts
    wide = MTPLayer(model.args, mlp_size=80)
    wide.update(widened(tree_map(lambda a: a, narrow.parameters()), wide))
    assert dict(tree_flatten(wide.parameters()))["block.mlp.gate_proj.weight"].shape == (80, 64)
    assert mx.abs(wide.block.mlp.up_proj.weight[48:]).max().item() > 0
    outs = lambda layer, depths: layer.unrolled(h, lambda j: embed(tokens[:, j : j + LENGTH]),
                                                depths, norm)  # fmt: skip
    for a, b in zip(outs(narrow, DEPTHS), outs(wide, DEPTHS)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    wide.block.mlp.down_proj.weight[:, 48:] = 1.0  # the check can fail: the new units do count
    assert not np.allclose(outs(narrow, 1)[0], outs(wide, 1)[0])
