"""PyTorch head checkpoints (Medusa's layout or our key names) -> clp-mlx heads.

Checkpoints are written with the torch-free ``save_torch_file``; the backbone is
the tiny random Qwen2 of ``conftest``.
"""

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx import nn
from mlx_lm.utils import save_config, save_model
from tokenizers import Tokenizer, models, pre_tokenizers

from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import load_heads
from clp_mlx.sources.torch_heads import backbone_output_projection, load_head_state, map_torch_head_keys
from clp_mlx.sources.torch_zip import save_torch_file

H, V = 64, 128


def medusa_state(k=3, *, proj=None, blocks=1, seed=0):
    """Medusa's medusa_lm_head state dict: k heads of `blocks` ResBlocks + a projection."""
    rng = np.random.default_rng(seed)
    state = {}
    for i in range(k):
        for j in range(blocks):
            state[f"{i}.{j}.linear.weight"] = rng.standard_normal((H, H)).astype(np.float32) * 0.02
            state[f"{i}.{j}.linear.bias"] = rng.standard_normal(H).astype(np.float32) * 0.02
        if proj is not None:
            state[f"{i}.{blocks}.weight"] = proj
    return state


def our_state(k=2, gate=8, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {f"heads.{i}.linear.weight": (H, H) for i in range(k)}
    shapes.update({f"heads.{i}.linear.bias": (H,) for i in range(k)})
    shapes.update(
        {
            "clp.weight": (k + 1, H),
            "clp.bias": (k + 1,),
            "gate.fc1.weight": (gate, H),
            "gate.fc1.bias": (gate,),
            "gate.fc2.weight": (k, gate),
            "gate.fc2.bias": (k,),
            "head0.linear.weight": (H, H),
            "head0.linear.bias": (H,),
        }
    )
    return {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}


def _map(state, out_proj=None, **kw):
    return map_torch_head_keys(state, hidden_size=H, vocab_size=V, out_proj=out_proj, **kw)


@pytest.fixture(scope="module")
def out_proj():
    return np.random.default_rng(1).standard_normal((V, H)).astype(np.float32)


def test_medusa_heads_keep_their_order_and_drop_the_shared_projection(out_proj, capsys):
    state = medusa_state(3, proj=out_proj + 1e-5)  # equal up to rounding
    mapped = _map(state, out_proj)
    assert sorted(mapped) == [f"heads.{i}.linear.{p}" for i in range(3) for p in ("bias", "weight")]
    # Medusa head i drafts t+2+i, as our head at list position i does.
    for i in range(3):
        np.testing.assert_array_equal(
            mapped[f"heads.{i}.linear.weight"], state[f"{i}.0.linear.weight"]
        )
        np.testing.assert_array_equal(mapped[f"heads.{i}.linear.bias"], state[f"{i}.0.linear.bias"])
    assert capsys.readouterr().err == ""


def test_medusa_heads_without_projection_or_resblock(out_proj):
    mapped = _map(medusa_state(2, blocks=0, proj=out_proj), out_proj)
    assert not mapped["heads.1.linear.weight"].any() and not mapped["heads.1.linear.bias"].any()
    assert sorted(_map(medusa_state(2))) == sorted(mapped)  # no projections saved at all


def test_a_different_projection_is_refused_unless_dropped(out_proj, capsys):
    state = medusa_state(2, proj=out_proj * 1.01)
    with pytest.raises(
        ClpError, match="head 0 has its own output projection.*--drop-head-projections"
    ):
        _map(state, out_proj)
    mapped = _map(state, out_proj, drop_head_projections=True)
    assert len(mapped) == 4
    err = capsys.readouterr().err
    assert "warning: dropping Medusa head 0" in err and "head 1" in err
    with pytest.raises(ClpError, match="unknown"):  # nothing to compare with
        _map(medusa_state(1, proj=out_proj), None)
    with pytest.raises(ClpError, match="shape"):
        _map(medusa_state(1, proj=out_proj[:-1]), out_proj)


def test_medusa_layouts_we_cannot_hold_are_refused(out_proj):
    with pytest.raises(ClpError, match="2 ResBlocks"):
        _map(medusa_state(2, blocks=2, proj=out_proj), out_proj)
    state = medusa_state(2)
    state["0.0.linear.weight"] = np.zeros((H + 1, H + 1), np.float32)
    with pytest.raises(ClpError, match="hidden size is 64"):
        _map(state)
    state = medusa_state(2)
    del state["1.0.linear.bias"]
    with pytest.raises(ClpError, match="both weight and bias"):
        _map(state)
    with pytest.raises(ClpError, match=r"0\.\.n-1"):
        _map({k: v for k, v in medusa_state(3).items() if not k.startswith("1.")})
    with pytest.raises(ClpError, match="base_model.norm.weight"):
        _map({**medusa_state(1), "base_model.norm.weight": np.ones(H, np.float32)})


def test_our_key_names_pass_through_with_every_shape_checked():
    state = our_state()
    mapped = _map(state)
    assert mapped.keys() == state.keys()
    minimal = {k: v for k, v in state.items() if k.startswith("heads.")}
    assert _map(minimal).keys() == minimal.keys()

    with pytest.raises(ClpError, match="unknown head weights: heads.0.extra, mystery"):
        _map({**state, "mystery": np.zeros(1), "heads.0.extra": np.zeros(1)})
    with pytest.raises(ClpError, match="gate.fc2.bias missing"):
        _map({k: v for k, v in state.items() if k != "gate.fc2.bias"})
    with pytest.raises(ClpError, match=r"clp.weight has shape \(2, 64\)"):
        _map({**state, "clp.weight": np.zeros((2, H), np.float32)})
    with pytest.raises(ClpError, match="0..k-1"):
        _map({k.replace("heads.1.", "heads.2."): v for k, v in minimal.items()})


def test_checkpoint_files_and_wrappers(tmp_path):
    state = medusa_state(2)
    save_torch_file(
        tmp_path / "wrapped.pt", {f"module.{k}": v for k, v in state.items()}, bfloat16=True
    )
    loaded = load_head_state(tmp_path / "wrapped.pt")
    assert sorted(loaded) == sorted(state)
    np.testing.assert_allclose(loaded["0.0.linear.weight"], state["0.0.linear.weight"], rtol=2**-8)
    mx.save_safetensors(
        str(tmp_path / "h.safetensors"),
        {k: mx.array(v).astype(mx.bfloat16) for k, v in state.items()},
    )
    assert sorted(load_head_state(tmp_path / "h.safetensors")) == sorted(state)


def test_quantized_backbone_projection_matches_after_the_same_round_trip():
    model = tiny_model(3, vocab=V, tied=False)
    original = np.array(model.lm_head.weight)
    nn.quantize(model, group_size=32, bits=4)
    out_proj, requantize = backbone_output_projection(model)
    assert requantize is not None and out_proj.shape == (V, H)
    assert _map(medusa_state(1, proj=original), out_proj, requantize=requantize)
    with pytest.raises(ClpError, match="differs"):
        _map(medusa_state(1, proj=original), out_proj)  # 4-bit error is far above 1e-3


def _mlx_folder(folder: Path, model) -> None:
    """A minimal MLX model folder that mlx_lm.load opens."""
    save_model(folder, model)
    args = model.args
    config = {
        k: getattr(args, k)
        for k in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "rms_norm_eps",
            "vocab_size",
            "num_key_value_heads",
            "rope_theta",
            "tie_word_embeddings",
        )
    }
    save_config(config, folder / "config.json")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet[:V])}, merges=[]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )


def _cli():
    path = Path(__file__).resolve().parents[1] / "convert" / "heads_from_torch.py"
    spec = importlib.util.spec_from_file_location("heads_from_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_cli_writes_heads_that_load_onto_the_backbone(tmp_path, capsys):
    model = tiny_model(0, vocab=V)
    _mlx_folder(tmp_path / "model", model)
    proj = np.array(model.model.embed_tokens.weight)  # tied: the embedding is the projection
    state = medusa_state(3, proj=proj)
    save_torch_file(tmp_path / "medusa_lm_head.pt", state)
    main, heads = _cli(), tmp_path / "heads"
    argv = [
        str(tmp_path / "medusa_lm_head.pt"),
        "--model",
        str(tmp_path / "model"),
        "-o",
        str(heads),
    ]
    assert main(argv) == 0
    bundle = load_heads(heads, model)
    assert bundle.k == 3
    np.testing.assert_allclose(np.array(bundle.heads[2].linear.weight), state["2.0.linear.weight"])
    assert (
        json.loads((heads / "heads.json").read_text())["extra"]["converted_from"]
        == "medusa_lm_head.pt"
    )

    assert main(argv) == 1
    assert "exists" in capsys.readouterr().err
    save_torch_file(tmp_path / "other.pt", medusa_state(2, proj=proj * 2))
    argv[0] = str(tmp_path / "other.pt")
    assert main(argv + ["--force"]) == 1
    assert "error: Medusa head 0 has its own output projection" in capsys.readouterr().err
    assert main(argv + ["--force", "--drop-head-projections"]) == 0
    assert "warning: dropping" in capsys.readouterr().err
    assert load_heads(heads, model).k == 2
