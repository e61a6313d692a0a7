"""The copy head (model/pointer.py): its mixture, decoding's drafts equal
the held-out report's, it saves and loads, and train_mtp trains it alone."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs
from mtp_helpers import attending_layer, train_argv, trained

from clp_mlx import api
from clp_mlx.cli.train_mtp import main as train_mtp
from clp_mlx.decode.choose import make_drafter
from clp_mlx.decode.copies_first import CopiesFirst
from clp_mlx.decode.drafters import PassDrafts
from clp_mlx.decode.layer_cache import LayerCache
from clp_mlx.decode.mtp_drafter import MTPDrafter
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import load_heads, save_heads
from clp_mlx.model.mtp_layer import MTPLayer
from clp_mlx.model.pointer import Pointer, copy_context, draft_ids, id_map
from clp_mlx.train.rows_eval import chain_drafts


def copying_layer(outside=True):
    """:func:`attending_layer` with a copy head that copies most of the time
    (``outside``: tokens outside the draft vocabulary too)."""
    model, bundle = attending_layer()
    layer = bundle.mtp
    shape = {**layer.shape(), "pointer": 8, **({"pointer_outside": True} if outside else {})}
    bundle.config.layer = shape
    copying = MTPLayer.of_shape(shape, model.args.hidden_size)
    copying.update(layer.parameters())
    mx.random.seed(3)
    copying.pointer.q.weight = mx.random.normal(copying.pointer.q.weight.shape)
    copying.pointer.choose.bias = mx.array([3.0])
    bundle.mtp = copying
    bundle.set_draft_vocab(list(range(64)))  # 77 and the like only a copy can draft
    return model, bundle


def test_the_mixture_adds_each_copy_once_and_gives_outside_tokens_their_first_column():
    p = Pointer(4, 2, outside=True)
    p.choose.bias = mx.array([0.0])  # c = 1/2
    p.choose.weight = mx.zeros_like(p.choose.weight)
    keys = mx.zeros((5, 2))  # every valid key alike
    vocab = np.array([7, 2, 9, 4, 5])  # the draft vocabulary: index i holds token vocab[i]
    offered = np.array([2, 2, 4, 11, 11])  # 11 is outside it: its first key (3) gets the column
    context = copy_context(offered, id_map(vocab, 12))
    valid = mx.array([[True] * 5])
    logp = p.mix(mx.zeros((1, 5)), mx.ones((1, 4)), keys, valid, context)
    probs = np.exp(np.array(logp[0]))
    inside = 0.5 * np.full(5, 0.2) + 0.5 * np.array([0, 2, 0, 1, 0]) / 5
    np.testing.assert_allclose(probs, [*inside, 0, 0, 0, 0.5 * 2 / 5, 0], atol=1e-5)
    assert probs.sum() == pytest.approx(1, abs=1e-4)
    ids = draft_ids(mx.array(vocab), 12, mx.array(offered))
    assert ids.tolist() == [7, 2, 9, 4, 5, 2, 2, 4, 11, 11]
    early = mx.array([[True, True, True, False, False]])  # the anchor sees the first three
    probs = np.exp(np.array(p.mix(mx.zeros((1, 5)), mx.ones((1, 4)), keys, early, context)[0]))
    np.testing.assert_allclose(probs[5:], 0, atol=1e-6)
    none = p.mix(mx.zeros((1, 5)), mx.ones((1, 4)), keys, valid & False, context)
    np.testing.assert_allclose(np.exp(np.array(none[0]))[:5], np.full(5, 0.2), atol=1e-5)
    p.outside = False  # it attends to the keys offering tokens of the vocabulary only
    probs = np.exp(np.array(p.mix(mx.zeros((1, 5)), mx.ones((1, 4)), keys, valid, context)[0]))
    np.testing.assert_allclose(probs, 0.1 + 0.5 * np.array([0, 2, 0, 1, 0]) / 3, atol=1e-5)


@pytest.mark.parametrize("outside", [True, False])
def test_decoding_drafts_what_the_report_drafts(outside):
    """At every anchor the drafter, following the committed tokens with its
    cache, drafts what the held-out report's unrolled pass drafts over the
    same positions; and the copy head changes drafts (else this proves nothing)."""
    model, bundle = copying_layer(outside)
    seq = mx.array(([5, 9, 17, 3, 77] * 8)[:36])  # repeats: something to copy
    hidden = model.model(seq[None])[0]
    drafter = MTPDrafter(model, bundle)
    drafter.prompt(hidden[:9], seq[1:10])
    whole, _ = chain_drafts(model, bundle, hidden[None, :30], seq[None])
    plain = MTPLayer.of_shape({**bundle.mtp.shape(), "pointer": 0}, model.args.hidden_size)
    plain.update({k: v for k, v in bundle.mtp.parameters().items() if k != "pointer"})
    bundle_plain = load_like(bundle, plain)
    without, _ = chain_drafts(model, bundle_plain, hidden[None, :30], seq[None])
    for end in range(9, 29):
        committed = seq[end + 1 : end + 2].tolist()
        drafter.observe(committed, PassDrafts(None, None, None, fed=hidden[end : end + 1]))
        assert drafter.candidates(3, 1)[0] == whole[0, end].tolist()
    assert (whole != without).any()
    # copies from outside the vocabulary: only where the copy head makes them
    assert (whole[0, 9:29] >= 64).any() == outside


def load_like(bundle, layer):
    """A copy of ``bundle`` whose MTP layer is ``layer``."""
    import copy

    other = copy.copy(bundle)
    other.mtp = layer
    return other


def test_the_cache_trims_and_copies_the_copy_keys():
    cache = LayerCache()
    kv = (mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)))
    cache.add(kv, [1, 2, 3, 4, 5], mx.arange(10).reshape(5, 2))
    assert cache.copy().copy_keys.shape == (5, 2)
    cache.trim(2)
    assert cache.copy_keys.tolist() == [[0, 1], [2, 3], [4, 5]] and cache.tokens == [1, 2, 3]


def test_a_drafter_with_a_copy_head_saves_loads_and_verify_stays_greedy(tmp_path):
    model, bundle = copying_layer()
    loaded = load_heads(save_heads(bundle, tmp_path / "copying"), model)
    assert loaded.config.layer["pointer"] == 8
    np.testing.assert_array_equal(loaded.mtp.pointer.q.weight, bundle.mtp.pointer.q.weight)
    prompt = [5, 9, 17, 3, 77, 41, 5, 9, 17, 3]
    plain = list(decode_pairs(prompt, model, loaded, max_tokens=30, mode="ar"))
    fast = list(decode_pairs(prompt, model, loaded, max_tokens=30, mode="verify"))
    assert [t for t, _ in fast] == [t for t, _ in plain]


def test_beside_a_copy_head_context_copies_come_from_the_longest_matches_only():
    model, bundle = copying_layer()
    bundle.use_context(3)
    config = api.decode_config(max_tokens=4).resolve(model, bundle)
    drafter = make_drafter(model, bundle, config, [])
    assert isinstance(drafter, CopiesFirst) and drafter.shortest == 3
    prompt = [5, 9, 17, 3, 77, 41, 5, 9, 17, 3, 77, 5, 9]
    plain = list(decode_pairs(prompt, model, bundle, max_tokens=30, mode="ar"))
    fast = list(decode_pairs(prompt, model, bundle, max_tokens=30, mode="verify"))
    assert [t for t, _ in fast] == [t for t, _ in plain]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("pointer"), steps=6)


def test_pointer_only_trains_the_copy_head_and_keeps_the_layer(root):
    from clp_mlx.api import load_with_drafter

    base = str(root / "m/drafter")
    flags = ["--init-from", base, "--pointer", "8", "--pointer-only", "--lr", "1e-2"]
    assert train_mtp(train_argv(root, "p", *flags)) == 0
    assert train_mtp(train_argv(root, "still", *flags, "--pointer-lr", "1e-12")) == 0
    backbone, _, _ = load_with_drafter(str(root / "tiny"), "none")
    before, after = load_heads(base, backbone), load_heads(root / "p/drafter", backbone)
    still = load_heads(root / "still/drafter", backbone)
    assert after.config.layer["pointer"] == 8
    np.testing.assert_array_equal(after.mtp.fc.weight, before.mtp.fc.weight)  # the layer kept
    moved = np.abs(np.array(after.mtp.pointer.q.weight - still.mtp.pointer.q.weight)).max()
    assert moved > 1e-3  # the copy head learned (the same start, one run at ~no rate)
    report = json.loads((root / "p/drafter/training.json").read_text())
    assert report["config"]["pointer_only"] and report["held_out"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--pointer-only", "--pointer", "8"], "--pointer-only trains a copy head"),
        (["--pointer-lr", "1e-3"], "--pointer-lr"),
        (["--pointer", "-1"], "--pointer must be"),
        (["--pointer-outside"], "--pointer-outside goes with --pointer"),
    ],
)
def test_copy_head_flags_are_refused_with_one_line(root, extra, message):
    with pytest.raises(ClpError, match=message):
        train_mtp(train_argv(root, "refused", *extra))


@pytest.mark.parametrize(
    "rank, outside, message",
    [(None, None, "unknown head weights"), ("x", None, "whole number"),
     (None, True, "only with a pointer"), (8, "yes", "must be true")],
)  # fmt: skip
def test_a_copy_head_heads_json_does_not_describe_is_refused(tmp_path, rank, outside, message):
    model, bundle = copying_layer(outside=False)
    folder = save_heads(bundle, tmp_path / "copying")
    config = json.loads((folder / "heads.json").read_text())
    config["layer"].pop("pointer")
    if rank is not None:
        config["layer"]["pointer"] = rank
    if outside is not None:
        config["layer"]["pointer_outside"] = outside
    (folder / "heads.json").write_text(json.dumps(config))
    with pytest.raises(ClpError, match=message):
        load_heads(folder, model)


def test_training_targets_outside_the_vocabulary_are_the_first_earlier_offer(root):
    from clp_mlx.train.mtp_data import Rows, batch

    rows = Rows.of([root / "data"])
    vocab = np.arange(0, 200, 3)  # a third of the tiny vocabulary: many targets outside it
    b = batch(rows, np.arange(4), 2, id_map(vocab, 256), copies="outside")
    offered, first = np.array(b["offered"]), b["first"]
    anchors = b["h"].shape[1] - first
    outside = 0
    for j in (1, 2):
        for at, y, t in zip(*(np.array(b[f"{k}{j}"]).tolist() for k in ("at", "y", "t"))):
            row, s = divmod(at, anchors)
            if y < len(vocab):
                assert vocab[y] == t
                continue
            m = y - len(vocab)
            assert offered[row, m] == t and m < s + first and t not in offered[row, :m]
            outside += 1
    assert outside > 0
