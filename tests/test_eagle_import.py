"""An EAGLE-1/2 draft head imported as an MTP-layer drafter computes what
EAGLE's own forward computes (written out here in numpy), and heads that do
not fit the backbone are refused with one error."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

from clp_mlx.decode.drafters import PassDrafts
from clp_mlx.decode.mtp_drafter import MTPDrafter
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import load_heads
from clp_mlx.sources.eagle_heads import convert_eagle

D, HEADS, KV, MLP = 64, 4, 2, 96


def eagle_state(seed=0, biases=True):
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)
    hd = D // HEADS
    state = {"fc.weight": w(D, 2 * D), "fc.bias": w(D), "embed_tokens.weight": w(128, D)}
    layer = {
        "self_attn.q_proj.weight": w(D, D), "self_attn.k_proj.weight": w(KV * hd, D),
        "self_attn.v_proj.weight": w(KV * hd, D), "self_attn.o_proj.weight": w(D, D),
        "mlp.gate_proj.weight": w(MLP, D), "mlp.up_proj.weight": w(MLP, D),
        "mlp.down_proj.weight": w(D, MLP), "post_attention_layernorm.weight": 1 + w(D),
    }  # fmt: skip
    if biases:
        layer.update({"self_attn.q_proj.bias": w(D), "self_attn.k_proj.bias": w(KV * hd),
                      "self_attn.v_proj.bias": w(KV * hd)})  # fmt: skip
    state.update({f"layers.0.{k}": v for k, v in layer.items()})
    return state


def save(state, path):
    mx.save_safetensors(str(path), {k: mx.array(v) for k, v in state.items()})
    return path


def eagle_forward(state, h, e, eps):
    """EAGLE's draft layer at one position (attention over itself alone)."""
    p = lambda k: state[f"layers.0.{k}"]
    u = state["fc.weight"] @ np.concatenate([e, h]) + state["fc.bias"]
    v = p("self_attn.v_proj.weight") @ u + p("self_attn.v_proj.bias")
    hd = D // HEADS
    per_head = [v[(i // (HEADS // KV)) * hd : (i // (HEADS // KV) + 1) * hd] for i in range(HEADS)]
    r = u + p("self_attn.o_proj.weight") @ np.concatenate(per_head)
    n = r / np.sqrt(np.mean(r**2) + eps) * p("post_attention_layernorm.weight")
    g = p("mlp.gate_proj.weight") @ n
    return r + p("mlp.down_proj.weight") @ (g / (1 + np.exp(-g)) * (p("mlp.up_proj.weight") @ n))


@pytest.mark.parametrize("biases", [True, False])
def test_an_imported_head_computes_eagles_forward(tmp_path, biases):
    model = tiny_model(0)
    state = eagle_state(1, biases)
    if not biases:
        state.update({f"layers.0.self_attn.{x}_proj.bias": np.zeros(n, np.float32)
                      for x, n in (("q", D), ("k", 32), ("v", 32))})  # fmt: skip
    folder = convert_eagle(save(eagle_state(1, biases), tmp_path / "e.safetensors"), model,
                           tmp_path / "drafter", k=3)  # fmt: skip
    bundle = load_heads(folder, model)
    h = np.array(model.model(mx.array([[7, 3, 9]]))[0, -1])
    token = 42
    e = np.array(model.model.embed_tokens.weight[token])
    x = bundle.mtp.fuse(mx.array(h)[None, None], mx.array(e)[None, None])
    g, _ = bundle.mtp.step(x, 0, None)
    want = eagle_forward(state, h, e, model.args.rms_norm_eps)
    np.testing.assert_allclose(np.array(g[0, 0]), want, rtol=1e-4, atol=1e-4)
    drafter = MTPDrafter(model, bundle)  # drafts from the raw output through the LM head
    drafter.observe([token], PassDrafts(None, None, None, fed=mx.array(h)[None]))
    logits = np.array(model.model.embed_tokens.weight) @ want
    assert drafter.candidates(3, 1)[0][0] == int(np.argmax(logits))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda s: s.update({"layers.1.mlp.up_proj.weight": s["layers.0.mlp.up_proj.weight"]}),
         "one decoder layer"),
        (lambda s: s.update({"fc.weight": s["fc.weight"][:, :100]}), "fc.weight has shape"),
        (lambda s: s.update({"layers.0.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
         "k_proj.weight has shape"),
        (lambda s: s.pop("fc.bias"), "missing"),
        (lambda s: s.update({"lm_head.weight": np.zeros((128, 64), np.float32)}), "not an EAGLE"),
        (lambda s: s["fc.bias"].__setitem__(0, np.nan), "not finite"),
    ],
)  # fmt: skip
def test_heads_that_do_not_fit_are_one_error(tmp_path, change, message):
    state = eagle_state()
    change(state)
    with pytest.raises(ClpError, match=message):
        convert_eagle(save(state, tmp_path / "e.safetensors"), tiny_model(0), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_the_converter_command(tmp_path):
    from conftest import write_model_folder

    from clp_mlx.cli.convert import main

    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    path = save(eagle_state(), tmp_path / "e.safetensors")
    out = tmp_path / "drafter"
    assert main(["heads-from-eagle", str(path), "--model", str(folder), "-o", str(out)]) == 0
    assert (out / "heads.json").is_file()
    assert main(["heads-from-eagle", str(path), "--model", str(folder), "-o", str(out)]) == 1
