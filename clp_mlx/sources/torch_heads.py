"""Convert PyTorch head checkpoints into clp-mlx heads (``heads.safetensors`` + ``heads.json``).

Two source layouts are understood (``H`` hidden size, ``V`` vocabulary, ``k``
heads, ``g`` gate width); both store linear weights as (out, in), like MLX:

=================================  ==========  ==============================
source key                         shape       clp-mlx key
=================================  ==========  ==============================
Medusa ``{i}.0.linear.weight``     (H, H)      ``heads.{i}.linear.weight``
Medusa ``{i}.0.linear.bias``       (H,)        ``heads.{i}.linear.bias``
Medusa ``{i}.1.weight``            (V, H)      dropped (see below)
``heads.{i}.linear.weight|bias``   (H, H)/(H,) same
``clp.weight`` / ``clp.bias``      (k+1, H)/…  same
``gate.fc1.weight`` / ``.bias``    (g, H)/(g,) same
``gate.fc2.weight`` / ``.bias``    (k, g)/(k,) same
``head0.linear.weight|bias``       (H, H)/(H,) same
=================================  ==========  ==============================

Medusa (``medusa_lm_head.pt``): head ``i`` is ``ResBlock`` x L, then its own
``Linear(H, V)`` at index ``L``; a ResBlock is ``x + SiLU(Wx + b)``, exactly
ours.  Medusa's head 0 drafts token t+2, as our first head does (the backbone
itself writes t+1), so Medusa head ``i`` stays at list position ``i``.  Our
heads share the backbone's output projection and hold one ResBlock each, so:
L > 1 is refused; L = 0 becomes a zero ResBlock (SiLU(0) = 0: the identity);
a head's own projection is accepted only if it equals the backbone's (relative
Frobenius distance <= 1e-3), or dropped with a warning when asked to.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from clp_mlx.errors import ClpError
from clp_mlx.sources.torch_zip import load_torch_file

PROJECTION_RTOL = 1e-3
# Wrappers that training scripts put around a state dict, stripped when every key has one.
_WRAPPERS = ("module.", "state_dict.", "model_state_dict.", "medusa_head.")
_MEDUSA_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")
_OUR_HEAD_KEY = re.compile(r"heads\.(\d+)\.linear\.(weight|bias)")


def load_head_state(path: str | Path) -> dict[str, np.ndarray]:
    """Read a head checkpoint (torch zip ``.pt``/``.bin`` or ``.safetensors``)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        import mlx.core as mx

        if not path.is_file():
            raise ClpError(f"{path}: no such file")
        try:  # mx.load, since numpy cannot hold the bfloat16 that heads are often saved in
            state = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}
        except (RuntimeError, ValueError) as e:
            raise ClpError(f"{path}: cannot read safetensors ({e})") from None
    else:
        state = load_torch_file(path)
    for wrapper in _WRAPPERS:
        if state and all(k.startswith(wrapper) for k in state):
            state = {k[len(wrapper) :]: v for k, v in state.items()}
    return state


def _relative_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||, in row chunks so a vocabulary-sized copy is never made."""
    num = den = 0.0
    for r in range(0, b.shape[0], 4096):
        x, y = a[r : r + 4096].astype(np.float64), b[r : r + 4096].astype(np.float64)
        num += float(np.sum((x - y) ** 2))
        den += float(np.sum(y**2))
    return (num / den) ** 0.5 if den > 0 else float(num > 0)


def _map_medusa(
    state: dict[str, np.ndarray],
    hidden_size: int,
    out_proj: np.ndarray | None,
    drop: bool,
    requantize: Callable[[np.ndarray], np.ndarray] | None,
) -> dict[str, np.ndarray]:
    parts: dict[int, dict[tuple[int, str], np.ndarray]] = {}
    for key, value in state.items():
        m = _MEDUSA_KEY.fullmatch(key)
        parts.setdefault(int(m[1]), {})[(int(m[2]), m[3])] = value
    if sorted(parts) != list(range(len(parts))):
        raise ClpError(f"Medusa head indices must run 0..n-1, got {sorted(parts)}")
    out: dict[str, np.ndarray] = {}
    for i, layers in sorted(parts.items()):
        blocks = sorted({j for j, kind in layers if kind.startswith("linear")})
        if len(blocks) > 1:
            raise ClpError(f"Medusa head {i} has {len(blocks)} ResBlocks; clp-mlx heads have one")
        n = len(blocks)
        allowed = {(0, "linear.weight"), (0, "linear.bias"), (n, "weight")}
        if blocks not in ([], [0]) or set(layers) - allowed:
            odd = sorted(f"{i}.{j}.{kind}" for j, kind in layers)
            raise ClpError(f"Medusa head {i} has an unexpected layout: {', '.join(odd)}")
        if n == 1:
            if (0, "linear.bias") not in layers or (0, "linear.weight") not in layers:
                raise ClpError(f"Medusa head {i}: the ResBlock needs both weight and bias")
            w, b = layers[(0, "linear.weight")], layers[(0, "linear.bias")]
            if w.shape != (hidden_size, hidden_size) or b.shape != (hidden_size,):
                raise ClpError(
                    f"Medusa head {i}'s ResBlock has shapes {w.shape}/{b.shape}; "
                    f"the backbone's hidden size is {hidden_size}"
                )
        else:  # no ResBlock: a zero block is the identity
            w = np.zeros((hidden_size, hidden_size), np.float32)
            b = np.zeros(hidden_size, np.float32)
        out[f"heads.{i}.linear.weight"], out[f"heads.{i}.linear.bias"] = w, b
        if (n, "weight") in layers:
            _check_projection(i, layers[(n, "weight")], out_proj, drop, requantize)
    return out


def _check_projection(
    i: int,
    proj: np.ndarray,
    out_proj: np.ndarray | None,
    drop: bool,
    requantize: Callable[[np.ndarray], np.ndarray] | None,
) -> None:
    """Accept head ``i``'s own output layer only if it is the backbone's; else refuse or warn."""
    if out_proj is None:
        why = "the backbone's output projection is unknown"
    elif proj.shape != out_proj.shape:
        why = f"it has shape {proj.shape}, the backbone's is {out_proj.shape}"
    else:
        dist = _relative_distance(requantize(proj) if requantize else proj, out_proj)
        if dist <= PROJECTION_RTOL:
            return
        why = f"it differs from the backbone's by {dist:.3g} (relative)"
    if not drop:
        raise ClpError(
            f"Medusa head {i} has its own output projection and {why}; clp-mlx heads use "
            "the backbone's (pass --drop-head-projections to drop it anyway)"
        )
    print(f"warning: dropping Medusa head {i}'s own output projection: {why}", file=sys.stderr)


def _map_ours(state: dict[str, np.ndarray], hidden_size: int) -> dict[str, np.ndarray]:
    ids = {int(m[1]) for k in state if (m := _OUR_HEAD_KEY.fullmatch(k))}
    k, h = len(ids), hidden_size
    if ids != set(range(k)):
        raise ClpError(f"head indices must run 0..k-1, got {sorted(ids)}")
    g = state["gate.fc1.weight"].shape[0] if "gate.fc1.weight" in state else 0
    groups: dict[str, dict[str, tuple[int, ...]]] = {
        f"heads.{i}": {"linear.weight": (h, h), "linear.bias": (h,)} for i in range(k)
    }
    groups["clp"] = {"weight": (k + 1, h), "bias": (k + 1,)}
    groups["gate"] = {
        "fc1.weight": (g, h),
        "fc1.bias": (g,),
        "fc2.weight": (k, g),
        "fc2.bias": (k,),
    }
    groups["head0"] = {"linear.weight": (h, h), "linear.bias": (h,)}
    expected = {
        f"{p}.{name}": shape for p, group in groups.items() for name, shape in group.items()
    }
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ClpError(f"unknown head weights: {', '.join(unknown)}")
    if not k:
        raise ClpError("the checkpoint holds no heads.{i}.linear weights")
    for prefix, group in groups.items():
        have = [f"{prefix}.{n}" in state for n in group]
        if (prefix.startswith("heads.") or any(have)) and not all(have):
            lacking = [f"{prefix}.{n}" for n, ok in zip(group, have) if not ok]
            raise ClpError(f"incomplete head weights: {', '.join(lacking)} missing")
    for key, value in state.items():
        if value.shape != expected[key]:
            raise ClpError(f"{key} has shape {value.shape}, this backbone needs {expected[key]}")
    return dict(state)


def map_torch_head_keys(
    state: dict[str, np.ndarray],
    *,
    hidden_size: int,
    vocab_size: int,
    out_proj: np.ndarray | None,
    drop_head_projections: bool = False,
    requantize: Callable[[np.ndarray], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Map a Medusa or clp-mlx-named state dict to clp-mlx key names (float32).

    Args:
        state: the checkpoint's tensors (see the module docstring for layouts).
        hidden_size, vocab_size: the target backbone's; every shape is checked.
        out_proj: the backbone's output projection (V, H), to compare Medusa
            heads' own projections with; ``None`` if unknown.
        drop_head_projections: drop per-head projections that are not the
            backbone's, with a warning, instead of refusing.
        requantize: applied to a per-head projection before comparing, to give
            it the quantization error of a quantized backbone's projection.

    Raises :class:`ClpError` naming unknown keys, and for wrong shapes, more than
    one ResBlock per head, or a per-head projection that is not the backbone's.
    """
    if not state:
        raise ClpError("the checkpoint holds no tensors")
    if out_proj is not None and out_proj.shape != (vocab_size, hidden_size):
        raise ValueError(f"out_proj has shape {out_proj.shape}, not {(vocab_size, hidden_size)}")
    if all(_MEDUSA_KEY.fullmatch(k) for k in state):
        mapped = _map_medusa(state, hidden_size, out_proj, drop_head_projections, requantize)
    elif any(_MEDUSA_KEY.fullmatch(k) for k in state):
        odd = sorted(k for k in state if not _MEDUSA_KEY.fullmatch(k))
        raise ClpError(f"unknown head weights next to Medusa ones: {', '.join(odd[:10])}")
    else:
        mapped = _map_ours(state, hidden_size)
    return {k: np.asarray(v, np.float32) for k, v in mapped.items()}


def backbone_output_projection(
    model: Any,
) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray] | None]:
    """The backbone's (V, H) output projection as float32, and for a quantized
    backbone a function giving another matrix the same quantization round trip."""
    import mlx.core as mx

    layer = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    if "scales" not in layer:
        return np.array(layer.weight.astype(mx.float32)), None
    q = {
        "group_size": layer.group_size,
        "bits": layer.bits,
        "mode": getattr(layer, "mode", "affine"),
    }
    parts = [layer.weight, layer.scales] + ([layer.biases] if "biases" in layer else [])
    weight = mx.dequantize(*parts, **q).astype(mx.float32)

    def requantize(a: np.ndarray) -> np.ndarray:
        return np.array(
            mx.dequantize(*mx.quantize(mx.array(a, mx.float32), **q), **q).astype(mx.float32)
        )

    return np.array(weight), requantize


def convert_torch_heads(
    src: str | Path,
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    force: bool = False,
    drop_head_projections: bool = False,
) -> Path:
    """Convert a PyTorch head checkpoint for the MLX model in ``model_dir``; return ``out_dir``."""
    from clp_mlx.model.heads_files import bundle_from_arrays, save_heads
    from clp_mlx.model.heads_files import holds_only_heads
    from clp_mlx.sources.converting import check_output, writing

    model_dir = Path(model_dir)
    out = check_output(out_dir, force, [Path(src), model_dir], ours=holds_only_heads)
    state = load_head_state(src)
    if not (model_dir / "config.json").is_file():
        raise ClpError(f"{model_dir} is not an MLX model folder (no config.json)")
    from mlx_lm import load

    try:
        model, _ = load(str(model_dir), lazy=True)
    except (FileNotFoundError, ValueError) as e:
        raise ClpError(f"{model_dir}: cannot load the model ({e})") from None
    if getattr(model, "model_type", None) != "qwen2":
        raise ClpError(
            f"{model_dir}: model_type {getattr(model, 'model_type', None)!r} is not qwen2"
        )
    out_proj, requantize = backbone_output_projection(model)
    arrays = map_torch_head_keys(
        state,
        hidden_size=model.args.hidden_size,
        vocab_size=model.args.vocab_size,
        out_proj=out_proj,
        drop_head_projections=drop_head_projections,
        requantize=requantize,
    )
    bundle = bundle_from_arrays(arrays, model=model, name=model_dir.name)
    with writing(out):
        return save_heads(bundle, out, force=force, extra={"converted_from": Path(src).name})
