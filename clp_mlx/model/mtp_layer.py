"""The MTP layer: one decoder layer, shared across draft depths, with attention.

As FastMTP's shared MTP module and EAGLE's draft head: at position ``s`` it
reads the backbone's hidden state ``h_s`` and the embedding of the token
after it, ``x_{s+1}``,

    u_s = W [RMSNorm(h_s) ; RMSNorm(embed(x_{s+1}))]          (W: 2d -> d)
    g_s = Block(u_s)          (one Qwen2 decoder layer, mlx-lm's class)

and drafts ``x_{s+2}`` through the backbone's final norm and output
projection. The next depth reads what the projection read, ``FinalNorm(g_s)``,
in place of a hidden state (the data's states are final-norm states too), with
the token it drafted, at position ``s + 1``; one set of weights drafts every
depth. Attention runs over the layer's own keys of earlier positions, which
follow the committed tokens (built from the backbone's hidden states).

:meth:`MTPLayer.unrolled` is the training form ("training-time test", as
EAGLE-3): all depths for every anchor ``s`` at once, where depth ``j`` at
anchor ``s`` sees depth-1 keys of anchors ``<= s`` and its own anchor's keys
of depths ``2..j``, exactly what decoding computes one step at a time
(:meth:`MTPLayer.step`; a test checks that the two agree).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from mlx import nn
from mlx_lm.models import qwen2

from .pointer import Pointer

SHAPE = {  # the block's config fields a drafter file records, and their types
    "num_attention_heads": int, "num_key_value_heads": int, "intermediate_size": int,
    "rms_norm_eps": float, "rope_theta": float, "max_position_embeddings": int,
}  # fmt: skip
# "mtp": ours (above). "eagle": EAGLE-1/2's draft head, imported as trained
# elsewhere: fc(+bias) over the raw [hidden; embedding] (columns reordered to
# ours at import), no norm before the attention, logits from the raw output.
STYLES = ("mtp", "eagle")
# What the style "mtp" layer's later depths read: "norm", FinalNorm(g) (since
# the layer's files record it; a layer trained to read g itself has no field).
FEED = "norm"


def block_args(args, mlp_size: int = 0):
    """The backbone's config for the layer's block, with an optional
    narrower MLP (``mlp_size`` 0: the backbone's own width)."""
    return replace(args, intermediate_size=mlp_size or args.intermediate_size)


class MTPLayer(nn.Module):
    def __init__(self, args, mlp_size=0, style="mtp", side_layers=(), pointer=0, outside=False):
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.style, self.side_layers = style, tuple(side_layers)
        if style == "mtp":
            self.h_norm = nn.RMSNorm(d, eps=eps)
            self.e_norm = nn.RMSNorm(d, eps=eps)
        if self.side_layers:  # EAGLE-3's earlier-layer features, added to depth 1's state
            self.side_norms = [nn.RMSNorm(d, eps=eps) for _ in self.side_layers]
            self.side_fc = nn.Linear(d * len(self.side_layers), d, bias=False)
            self.side_fc.weight = mx.zeros_like(self.side_fc.weight)  # starts as without them
        self.fc = nn.Linear(2 * d, d, bias=style == "eagle")
        self.block = qwen2.TransformerBlock(block_args(args, mlp_size))
        if pointer:  # a copy head of this rank (model/pointer.py)
            self.pointer = Pointer(d, pointer, outside)

    @classmethod
    def of_shape(cls, shape: dict, hidden_size: int) -> MTPLayer:
        """A layer of the recorded ``shape`` (:meth:`shape`)."""
        args = qwen2.ModelArgs(
            model_type="qwen2", hidden_size=hidden_size, num_hidden_layers=1,
            vocab_size=1, **{k: shape[k] for k in SHAPE},
        )  # fmt: skip
        style, side = shape.get("style", "mtp"), shape.get("side_layers", ())
        copy = {"pointer": shape.get("pointer", 0), "outside": shape.get("pointer_outside", False)}
        return cls(args, style=style, side_layers=side, **copy)

    def shape(self) -> dict:
        """What :meth:`of_shape` needs (besides the hidden size) to make this layer again."""
        args = self.block.args
        shape = {k: t(getattr(args, k)) for k, t in SHAPE.items()}
        side = {"side_layers": list(self.side_layers)} if self.side_layers else {}
        feed = {"feed": FEED} if self.style == "mtp" else {}
        copy = {"pointer": self.pointer.rank} if "pointer" in self else {}
        if copy and self.pointer.outside:
            copy["pointer_outside"] = True
        return {**shape, "style": self.style, **feed, **side, **copy}

    def readout(self, final_norm: nn.Module, g: mx.array) -> mx.array:
        """What the output projection, and the next depth, read of an output
        ``g``: the backbone's final norm of it (EAGLE's heads: ``g`` itself).
        Reading ``g`` itself, the next depth's input lacked the final norm's
        weight (mean 7.2 on the 0.5B) that depth 1's has."""
        return final_norm(g) if self.style == "mtp" else g

    def start_as_backbone(self, final_norm: nn.RMSNorm) -> None:
        """Start where the backbone's output is: the block's residual branches
        at zero, the embedding's input at zero, and the hidden state's norm
        undoing the final norm's weight, so that the final norm of a fresh
        layer's output is its input ``h``, and its first drafts are the
        backbone's own next-token choice (as this project's Medusa heads
        start at the identity). A random start meets the final norm's large
        weights and makes confident nonsense: a first loss of ~35 nats.

        The norm's weight is ``rms(w) / w``, not ``1 / w``: the same drafts
        (the final norm ignores scale), with a residual stream of about unit
        RMS (0.17 with ``1 / w`` on the 0.5B), next to which the branches
        start small. Held out at step 200, t+2 drafts were right 39.5% of
        the time against 28.1% (docs/EXPERIMENTS.md, "The MTP layer
        against the heads")."""
        w = final_norm.weight.astype(mx.float32)
        rms = mx.sqrt(mx.mean(w * w))
        self.h_norm.weight = rms / mx.where(mx.abs(w) < 1e-3, 1e-3, w)
        d = w.shape[0]
        self.fc.weight = mx.concatenate([mx.eye(d), mx.zeros((d, d))], axis=1)
        self.block.self_attn.o_proj.weight = mx.zeros_like(self.block.self_attn.o_proj.weight)
        self.block.mlp.down_proj.weight = mx.zeros_like(self.block.mlp.down_proj.weight)

    def fuse(self, h: mx.array, emb: mx.array) -> mx.array:
        """The block's input from a state ``h`` (..., d) and the next token's
        embedding. A wider ``h`` carries the earlier layers' states after the
        last one's (:attr:`side_layers`; depth 1 only): the layer adds
        ``side_fc`` of their norms to the last one's norm."""
        d = emb.shape[-1]
        if self.style == "eagle":
            return self.fc(mx.concatenate([h[..., :d], emb], axis=-1))
        x = self.h_norm(h[..., :d])
        if self.side_layers and h.shape[-1] > d:
            normed = [n(h[..., (i + 1) * d : (i + 2) * d]) for i, n in enumerate(self.side_norms)]
            x = x + self.side_fc(mx.concatenate(normed, axis=-1))
        return self.fc(mx.concatenate([x, self.e_norm(emb)], axis=-1))

    def qkv(self, x: mx.array, offset: int):
        """Queries (B, H, L, hd), keys and values (B, Hkv, L, hd) of ``x``
        (B, L, d) at positions ``offset ..``."""
        attn, (b, n, _) = self.block.self_attn, x.shape
        x = self.block.input_layernorm(x) if self.style == "mtp" else x
        q = attn.q_proj(x).reshape(b, n, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(x).reshape(b, n, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

    def finish(self, x: mx.array, heads_out: mx.array) -> mx.array:
        """The block after attention: output projection, residual, MLP."""
        b, _, n, _ = heads_out.shape
        h = x + self.block.self_attn.o_proj(heads_out.transpose(0, 2, 1, 3).reshape(b, n, -1))
        return h + self.block.mlp(self.block.post_attention_layernorm(h))

    def step(self, x: mx.array, offset: int, past: tuple | None, mask=None):
        """Decoding: ``x`` (1, n, d) fused inputs at positions ``offset..``,
        attending over ``past`` (keys, values) and causally over themselves.
        Returns the outputs (1, n, d) and the keys and values with these."""
        q, k, v = self.qkv(x, offset)
        if past is not None:
            k, v = mx.concatenate([past[0], k], axis=2), mx.concatenate([past[1], v], axis=2)
        n, total = x.shape[1], k.shape[2]
        if mask is None and n > 1:
            mask = mx.arange(total)[None] <= (total - n + mx.arange(n))[:, None]
        scale = self.block.self_attn.scale
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return self.finish(x, out), (k, v)

    def unrolled(self, h, tokens_emb, depths: int, final_norm, drafted=None, first: int = 0):
        """Training: outputs per depth, each (B, L - first, d), for anchors
        ``s >= first`` of ``h`` (B, L, d); earlier anchors give only their
        depth-1 keys (rows' prompts, where no target is: a fifth to a half
        of the block's work). ``tokens_emb(j)`` gives the embeddings (B, L, d)
        of the token each anchor's depth ``j`` reads (1-based: ``x_{s+j}``);
        ``final_norm``: the backbone's (:meth:`readout`).
        With ``drafted`` (outputs -> embeddings of their drafts), depths
        after the first read their own drafts instead, as decoding does."""
        attn = self.block.self_attn
        groups = attn.n_heads // attn.n_kv_heads
        length = h.shape[1]
        causal = mx.arange(length)[None] <= mx.arange(first, length)[:, None]
        feature, outs, own_k, own_v = None, [], [], []
        wide = self.fc.weight.shape[0] * (1 + len(self.side_layers))
        if self.side_layers and h.shape[-1] != wide:
            raise ValueError(f"this layer reads {1 + len(self.side_layers)} layers' states")
        for j in range(1, depths + 1):
            if j == 1:  # every anchor's keys; queries from the first on
                x = self.fuse(h, tokens_emb(1))
                q, k, v = self.qkv(x, 0)
                x, q = x[:, first:], q[:, :, first:]
                k1 = mx.repeat(k, groups, axis=1)
                v1 = mx.repeat(v, groups, axis=1)
            else:
                emb = tokens_emb(j)[:, first:] if drafted is None else drafted(feature)
                x = self.fuse(self.readout(final_norm, feature), emb)
                q, k, v = self.qkv(x, first + j - 1)
                own_k.append(mx.repeat(k, groups, axis=1))
                own_v.append(mx.repeat(v, groups, axis=1))
            scores = (q * attn.scale) @ k1.swapaxes(-1, -2)  # (B, H, L - first, L)
            scores = mx.where(causal, scores, -mx.inf)
            diag = [mx.sum(q * attn.scale * kk, axis=-1, keepdims=True) for kk in own_k]
            p = mx.softmax(mx.concatenate([scores, *diag], axis=-1), axis=-1, precise=True)
            out = p[..., :length] @ v1
            for i, vv in enumerate(own_v):
                out = out + p[..., length + i : length + i + 1] * vv
            feature = self.finish(x, out)
            outs.append(feature)
        return outs
