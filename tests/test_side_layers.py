"""Earlier layers' states (EAGLE-3's low and middle features): distill keeps
them beside the last layer's, and an MTP layer trained with --side reads them
at depth 1, starting exactly where the same layer without them is."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs, tiny_model, write_model_folder
from mlx_lm.models.base import create_attention_mask
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.qwen2 import TransformerBlock

from clp_mlx.cli.distill import main as distill
from clp_mlx.cli.train_mtp import main as train_mtp
from clp_mlx.decode.mtp_drafter import MTPDrafter
from clp_mlx.errors import ClpError
from clp_mlx.model.backbone import hidden_states, load_backbone
from clp_mlx.model.heads_files import load_heads
from clp_mlx.model.layer_states import layer_outputs, watch_layers
from clp_mlx.model.mtp_layer import MTPLayer
from clp_mlx.train import mtp_trainer
from clp_mlx.train.mtp_data import Rows
from clp_mlx.train.rows_eval import evaluate_rows

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def make_data(root, out: str, *side: int):
    rng = np.random.default_rng(0)
    lines = [" " + " ".join(rng.choice(WORDS, rng.integers(6, 30))) + " ." for _ in range(40)]
    (root / "wiki.txt").write_text("\n".join(lines) + "\n")
    argv = ["--model", str(root / "tiny"), "--out", str(root / out), "--kind", "wikitext",
            "--data", str(root / "wiki.txt"), "--prompts", "16", "--prompt-tokens", "6",
            "--new-tokens", "12", "--batch", "4", "--shard-size", "8", "--heldout", "0.25",
            "--quiet"]  # fmt: skip
    return distill(argv + (["--side-layers", *map(str, side)] if side else []))


def train(root, data: str, out: str, *extra: str):
    argv = ["--model", str(root / "tiny"), "--data", str(root / data), "--out", str(root / out),
            "--steps", "12", "--batch", "4", "--depths", "2", "--mlp-size", "32", "--lr", "3e-3",
            "--draft-vocab", "64", "--warmup", "2", "--checkpoint-every", "6", "--quiet"]  # fmt: skip
    return train_mtp(argv + list(extra))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("side_layers")
    write_model_folder(root / "tiny", tiny_model(0, layers=3))
    assert make_data(root, "plain") == 0
    assert make_data(root, "side", 1, 2) == 0
    assert train(root, "plain", "base") == 0
    assert train(root, "side", "fused", "--side", "--init-from", str(root / "base/drafter")) == 0
    return root


def names(model):
    return [k for k, _ in tree_flatten(model.parameters())]


def test_layer_outputs_are_the_states_after_n_layers_and_the_model_is_restored():
    model = tiny_model(0, layers=3)
    before, weights = list(model.model.layers), names(model)
    x = mx.array([[5, 9, 17, 33, 2]])
    with layer_outputs(model, (1, 2)) as got:
        final = model.model(x)
        assert names(model) == weights  # the same tree while recording
        assert all(isinstance(a, TransformerBlock) for a in model.model.layers)
    assert [type(a) for a in model.model.layers] == [type(a) for a in before]
    h = model.model.embed_tokens(x)
    mask = create_attention_mask(h, None)
    for n, layer in enumerate(model.model.layers[:2], 1):
        h = layer(h, mask, None)
        np.testing.assert_allclose(np.array(got[n][0]), np.array(h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(model.model(x)), np.array(final), rtol=1e-6, atol=1e-6)
    with pytest.raises(ClpError, match="1 to 2"):
        with layer_outputs(model, (3,)):
            pass
    watched = watch_layers(model, (2,))
    model.model(x)
    model.model(x[:, :3])
    assert len(watched[2]) == 1 and watched[2][0].shape == (1, 3, 64)  # the latest pass only
    assert watch_layers(model, (2,))[2] is watched[2] and names(model) == weights


def test_distill_keeps_the_side_states_and_the_same_rows(root):
    plain = Rows.of([root / "plain"])
    side = Rows.of([root / "side"])
    assert plain.side_layers == () and side.side_layers == (1, 2)
    assert Rows.of([root / "plain", root / "side"]).side_layers == ()  # not kept by all
    for a, b in zip(plain.parts, side.parts):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["hidden"], b["hidden"])
        assert b["side"].shape == (*b["tokens"].shape, 2, 64)
    h, *_ = side.gather(np.arange(2), 2, side=True)
    narrow, *_ = side.gather(np.arange(2), 2)
    assert h.shape[-1] == 3 * 64 and narrow.shape[-1] == 64
    np.testing.assert_array_equal(h[..., :64], narrow)
    assert "side_layers" not in json.loads((root / "plain/manifest.json").read_text())["settings"]


def test_a_layer_with_side_inputs_starts_as_the_layer_without():
    model = tiny_model(0, layers=3)
    mx.random.seed(1)
    plain = MTPLayer(model.args, 32)
    fused = MTPLayer(model.args, 32, side_layers=(1, 2))
    fused.update(plain.parameters())
    h = mx.random.normal((1, 7, 64 * 3))
    emb = lambda j: model.model.embed_tokens(mx.arange(j, j + 7)[None] % 128)
    a = plain.unrolled(h[..., :64], emb, 2, model.model.norm)
    b = fused.unrolled(h, emb, 2, model.model.norm)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="3 layers"):
        fused.unrolled(h[..., :64], emb, 2, model.model.norm)


def test_training_with_side_moves_its_weights_and_records_them(root, capsys):
    model, _ = load_backbone(root / "tiny")
    bundle = load_heads(root / "fused/drafter", model)
    assert bundle.mtp.side_layers == (1, 2)
    assert float(mx.abs(bundle.mtp.side_fc.weight).max()) > 0  # it learned to read them
    capsys.readouterr()
    argv = ["--eval", "--lookup", "0", "--side", "--init-from", str(root / "base/drafter")]
    assert train(root, "side", "fused", *argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 12 and report["side"]["accepted_by_depth"]["t+2"] >= 0


def test_side_lr_is_the_side_projections_own_rate_and_resumes(root, monkeypatch):
    """--side-lr moves the side projection at its own rate (here almost not at
    all) while the rest learns at --lr; a killed run resumes to the same weights."""
    model, _ = load_backbone(root / "tiny")
    base = root / "base/drafter"
    slow = ["--side", "--init-from", str(base), "--side-lr", "1e-9"]
    assert train(root, "side", "slow_side", *slow) == 0
    layer, start = load_heads(root / "slow_side/drafter", model).mtp, load_heads(base, model).mtp
    assert float(mx.abs(layer.side_fc.weight).max()) < 1e-6  # from zero, steps of ~1e-9
    assert not np.allclose(np.array(layer.fc.weight), np.array(start.fc.weight))
    step = mtp_trainer.MTPTrainer.train_step

    def dying(self):
        if self.step == 8:  # after the checkpoint at step 6
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(mtp_trainer.MTPTrainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        train(root, "side", "killed_side", *slow)
    monkeypatch.setattr(mtp_trainer.MTPTrainer, "train_step", step)
    assert train(root, "side", "killed_side", *slow) == 0
    whole = dict(tree_flatten(layer.parameters()))
    resumed = dict(tree_flatten(load_heads(root / "killed_side/drafter", model).mtp.parameters()))
    for name in whole:
        np.testing.assert_array_equal(np.array(whole[name]), np.array(resumed[name]), err_msg=name)
    with pytest.raises(ClpError, match="only with --side"):
        train(root, "side", "z", "--side-lr", "1e-3")


def test_what_cannot_read_side_states_is_refused(root, tmp_path):
    with pytest.raises(ClpError, match="keeps no earlier layers"):
        train(root, "plain", "x", "--side")
    with pytest.raises(ClpError, match="reads the states after layers"):
        train(root, "plain", "y", "--init-from", str(root / "fused/drafter"))
    with pytest.raises(ClpError, match="1 to 2 on this model"):
        make_data(root, "bad", 3)
    assert not (root / "bad").exists() or not list((root / "bad").glob("shard-*"))
    with pytest.raises(ClpError, match="repeats a layer"):
        make_data(root, "bad2", 1, 1)
    model, _ = load_backbone(root / "tiny")
    bundle = load_heads(root / "fused/drafter", model)
    narrow = Rows.of([root / "plain"], heldout=True)
    with pytest.raises(ClpError, match="keeps none"):
        evaluate_rows(model, bundle, narrow)


def layer_drafts(model, bundle, wide, tokens, drafts):
    """The layer's drafts at the last anchor of ``wide`` (1, n, 3d), computed at once."""
    n, embed = wide.shape[1], model.model.embed_tokens
    seq = mx.concatenate([tokens, mx.array(drafts)])
    outs = bundle.mtp.unrolled(wide, lambda j: embed(seq[None, j : j + n]), 2, model.model.norm)
    out = []
    for g in outs:
        scores, ids = bundle._draft_scores(model, bundle.mtp.readout(model.model.norm, g[0, -1:]))
        out.append(int(ids[mx.argmax(scores, axis=-1)][0]))
    return out


def test_decoding_reads_the_side_states_of_each_pass(root):
    """The drafter's drafts after a prefill and a pass are the layer's drafts
    computed at once from the states of one forward over the same tokens."""
    model, _ = load_backbone(root / "tiny")
    bundle = load_heads(root / "fused/drafter", model)
    mx.random.seed(5)  # side states that matter, so that reading the wrong ones shows
    bundle.mtp.side_fc.weight = mx.random.normal(bundle.mtp.side_fc.weight.shape) * 0.5
    tokens = mx.array([5, 9, 17, 33, 2, 71, 40, 8, 23, 64, 11])
    drafter = MTPDrafter(model, bundle)
    cache = make_prompt_cache(model)
    drafter.prompt(hidden_states(model, tokens[:8], cache), tokens[1:9])
    got = drafter.at(hidden_states(model, tokens[8:9], cache), None, None)
    drafter.observe([int(tokens[9])], got)
    drafts = drafter.candidates(2, 1)[0]
    with layer_outputs(model, (1, 2)) as side:
        final = model.model(tokens[None, :9])
    wide = mx.concatenate([final, side[1][0], side[2][0]], axis=-1)
    assert drafts == layer_drafts(model, bundle, wide, tokens[:10], drafts)
    blind = bundle.mtp.side_fc.weight
    bundle.mtp.side_fc.weight = mx.zeros_like(blind)  # the same layer, not reading them
    assert drafts != layer_drafts(model, bundle, wide, tokens[:10], drafts)
    bundle.mtp.side_fc.weight = blind
    prompt = [5, 9, 17, 3, 77, 41, 5, 9, 17]
    plain = list(decode_pairs(prompt, model, bundle, max_tokens=24, mode="ar"))
    fast = list(decode_pairs(prompt, model, bundle, max_tokens=24, mode="verify"))
    assert [t for t, _ in fast] == [t for t, _ in plain]
    assert len(list(decode_pairs(prompt, model, bundle, max_tokens=24, mode="clp"))) == 24
