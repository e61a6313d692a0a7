"""Import an EAGLE-1/2 draft head, trained elsewhere, as an MTP-layer drafter.

EAGLE's head for a Qwen2 backbone (``pytorch_model.bin`` or ``.safetensors``)
is ``fc: Linear(2H -> H, bias)`` over ``[embedding(x_{t+1}); feature h_t]``
(h_t: the backbone's final-norm hidden state, the input of its LM head) and
one decoder layer without the norm before its attention; the backbone's LM
head reads the layer's output as it is. That is the MTP layer's "eagle"
style (:mod:`clp_mlx.model.mtp_layer`), with fc's two column blocks swapped
into our [hidden; embedding] order:

=============================================  =========================================
EAGLE key                                      clp-mlx key
=============================================  =========================================
``fc.weight`` (H, 2H), ``fc.bias`` (H,)        ``mtp.fc.weight`` (columns swapped), ``.bias``
``layers.0.self_attn.{q,k,v,o}_proj.*``        ``mtp.block.self_attn.{q,k,v,o}_proj.*``
``layers.0.mlp.{gate,up,down}_proj.weight``    ``mtp.block.mlp.*``
``layers.0.post_attention_layernorm.weight``   ``mtp.block.post_attention_layernorm.weight``
``embed_tokens.weight``                        dropped (the backbone's own is used)
=============================================  =========================================

Every shape is checked against the backbone (hidden size, heads, key-value
heads); q/k/v biases that the checkpoint lacks are zeros.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ClpError
from .torch_heads import load_head_state

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_PARTS = {
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
    "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "post_attention_layernorm.weight",
}  # fmt: skip
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def eagle_arrays(state: dict, args, where: str) -> tuple[dict, dict]:
    """(our arrays, the layer's shape) from an EAGLE head's ``state``, checked
    against the backbone's ``args``."""
    d = args.hidden_size
    head_dim = d // args.num_attention_heads
    state = {k.removeprefix("model."): v for k, v in state.items()}
    layers = {m.group(1) for k in state if (m := _LAYER.fullmatch(k))}
    if layers != {"0"}:
        raise ClpError(
            f"{where}: an EAGLE head has one decoder layer, this one has {sorted(layers)}"
        )
    unknown = sorted(
        k for k in state
        if k not in ("fc.weight", "fc.bias", "embed_tokens.weight")
        and not (k.startswith("layers.0.") and k[9:] in _PARTS)
    )  # fmt: skip
    if unknown:
        raise ClpError(f"{where}: not an EAGLE-1/2 head (unknown weights {', '.join(unknown[:4])})")
    layer = {k[9:]: v for k, v in state.items() if k.startswith("layers.0.")}
    missing = sorted(_PARTS - set(_BIASES) - set(layer))
    if "fc.weight" not in state or "fc.bias" not in state or missing:
        raise ClpError(f"{where}: missing weights {', '.join(missing or ['fc.weight/fc.bias'])}")
    gate = layer["mlp.gate_proj.weight"]
    kv = args.num_key_value_heads * head_dim
    need = {
        "fc.weight": (d, 2 * d), "fc.bias": (d,),
        "self_attn.q_proj.weight": (d, d), "self_attn.q_proj.bias": (d,),
        "self_attn.k_proj.weight": (kv, d), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, d), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (d, d), "mlp.gate_proj.weight": (gate.shape[0], d),
        "mlp.up_proj.weight": (gate.shape[0], d), "mlp.down_proj.weight": (d, gate.shape[0]),
        "post_attention_layernorm.weight": (d,),
    }  # fmt: skip
    for bias in _BIASES:
        layer.setdefault(bias, np.zeros(need[bias], dtype=np.float32))
    got = {**layer, "fc.weight": state["fc.weight"], "fc.bias": state["fc.bias"]}
    for name, shape in need.items():
        if tuple(got[name].shape) != shape:
            raise ClpError(f"{where}: {name} has shape {tuple(got[name].shape)}; "
                           f"this backbone needs {shape}")  # fmt: skip
        if not np.all(np.isfinite(got[name])):
            raise ClpError(f"{where}: {name} holds values that are not finite")
    fc = state["fc.weight"]
    out = {"mtp.fc.weight": np.concatenate([fc[:, d:], fc[:, :d]], axis=1),
           "mtp.fc.bias": state["fc.bias"],
           "mtp.block.input_layernorm.weight": np.ones(d, dtype=np.float32)}  # fmt: skip
    out.update({f"mtp.block.{k}": v for k, v in layer.items()})
    shape = {
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "intermediate_size": int(gate.shape[0]), "rms_norm_eps": float(args.rms_norm_eps),
        "rope_theta": float(args.rope_theta),
        "max_position_embeddings": int(args.max_position_embeddings), "style": "eagle",
    }  # fmt: skip
    return out, shape


def convert_eagle(checkpoint, model, out, *, k: int = 4, force: bool = False) -> Path:
    """Write an MTP-layer drafter folder ``out`` from the EAGLE head
    ``checkpoint`` for the loaded ``model``; ``k``: the drafts it makes per step."""
    from ..model.heads_checks import CONTEXT_NGRAM
    from ..model.heads_files import init_heads, save_heads

    arrays, shape = eagle_arrays(load_head_state(checkpoint), model.args, str(checkpoint))
    bundle = init_heads(model, k, design="mtp", gate=False, head0=False,
                        name=f"EAGLE head {Path(checkpoint).name}", layer=shape)  # fmt: skip
    bundle.config.tree_branches = 1
    bundle.use_context(CONTEXT_NGRAM)  # verify drafts copies first where the context matches
    dtype = bundle.clp.weight.dtype
    bundle.load_weights([(n, mx.array(v).astype(dtype)) for n, v in arrays.items()], strict=False)
    return save_heads(bundle, out, force=force, extra={"imported_from": str(checkpoint)})
