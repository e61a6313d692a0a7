"""MTP heads, the CLP length predictor and the paper's baselines.

Backbone-as-Architect: the backbone's own output writes token t+1; head i
(i = 1..k) drafts token t+1+i from the same hidden state at t. No head ever
predicts t+1, except ``head0``, which exists only to reproduce the paper's
"prior MTP" failure mode.

Every head returns a hidden vector; all of them go through the backbone's
shared output projection, so drafting costs k small blocks plus extra rows in
one matmul, not k vocabulary-sized layers.

Files, fresh heads and the backbone check: :mod:`.heads_files`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import backbone
from .mtp_layer import MTPLayer
from ..errors import ClpError

FORMAT = "clp-mlx-heads"
DESIGNS = ("medusa", "embed", "chain", "mtp")
GATE_PARAMS = 1_000_000  # the paper's gate baseline is "about 1M parameters"
PROBE_MIN_COSINE = 0.99  # same weights in fp32/fp16/4-bit agree to > 0.995


class ResBlock(nn.Module):
    """x + SiLU(Wx + b), zero-initialised so a fresh block is the identity."""

    def __init__(self, dims: int):
        super().__init__()
        self.linear = nn.Linear(dims, dims)
        self.linear.weight = mx.zeros_like(self.linear.weight)
        self.linear.bias = mx.zeros_like(self.linear.bias)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class EmbedHead(nn.Module):
    """A head that also sees the embedding of the backbone's token t+1.

    EAGLE and DeepSeek's MTP condition the draft on the token just chosen,
    which the hidden state at t cannot know. ``fuse`` starts as [I | 0], so a
    fresh head ignores the embedding and equals a fresh Medusa head. The
    embedding is RMS-normalised first: Qwen2.5's final hidden rows are ~300x
    longer than its embedding rows, which would otherwise starve that input.
    """

    def __init__(self, dims: int):
        super().__init__()
        self.emb_norm = nn.RMSNorm(dims)
        self.fuse = nn.Linear(2 * dims, dims, bias=False)
        eye = mx.eye(dims, dtype=self.fuse.weight.dtype)
        self.fuse.weight = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
        self.block = ResBlock(dims)

    def __call__(self, h: mx.array, tok_emb: mx.array) -> mx.array:
        return self.block(self.fuse(mx.concatenate([h, self.emb_norm(tok_emb)], axis=-1)))


class Gate(nn.Module):
    """Medusa-style per-token gate: one accept score per head from an MLP."""

    def __init__(self, dims: int, k: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dims, hidden)
        self.fc2 = nn.Linear(hidden, k)

    def __call__(self, h: mx.array) -> mx.array:
        return self.fc2(nn.silu(self.fc1(h)))


def accept_count(logits: mx.array, threshold: float | None = None) -> mx.array:
    """CLP's decision from its scores over run lengths 0..k (last axis)."""
    if threshold is None:
        return mx.argmax(logits, axis=-1)
    probs = mx.softmax(logits, axis=-1)
    at_least = mx.cumsum(probs[..., ::-1], axis=-1)[..., ::-1]  # P(run >= n), n = 0..k
    return mx.sum(at_least[..., 1:] >= threshold, axis=-1)


class DraftSlice:
    """The draft vocabulary's rows of the output projection, made once per
    backbone (dequantized if it is quantized); kept in fp32 on the CPU,
    where BLAS serves only fp32, else in the projection's dtype. A plain
    object, so no parameter of the bundle."""

    def __init__(self):
        self._of = None  # a weak reference to the output weight the slice came from
        self._rows = None

    def weight(self, model: nn.Module, ids: mx.array) -> mx.array:
        source = backbone.output_layer(model).weight
        if self._of is None or self._of() is not source:  # first use, or another backbone
            rows = backbone.output_rows(model, ids)
            if mx.default_device() == mx.cpu:
                rows = rows.astype(mx.float32)
            mx.eval(rows)
            self._of, self._rows = weakref.ref(source), rows
        return self._rows


def gate_hidden_size(dims: int, k: int) -> int:
    """Width that brings the gate to about 1M parameters, at most 4x ``dims``
    (a transformer MLP's ratio). Every Qwen2.5 (896 wide and up) gets its 1M;
    the cap keeps a test's tiny model from a gate 200 times its own width."""
    return max(1, min(4 * dims, round((GATE_PARAMS - k) / (dims + 1 + k))))


@dataclass
class HeadsConfig:
    k: int
    design: str = "medusa"
    hidden_size: int = 0
    vocab_size: int = 0
    num_layers: int = 0
    fingerprint: str = ""
    probe: list = field(default_factory=list, repr=False)
    gate_hidden: int = 0  # 0: no gate baseline in this bundle
    head0: bool = False  # the prior-MTP baseline's competing t+1 head
    draft_vocab: int = 0  # >0: heads draft only from this many frequent tokens (FR-Spec)
    lookup: int = 0  # >0: context drafts (lookup.py) up to this n-gram; CLP knows the match
    clp_norm: bool = False  # CLP sees h / rms(h) (fitted so since the context drafts)
    tree_branches: int = 5  # verify trees: head 1's best tokens a tree holds (1: a chain)
    backbone: str = ""  # a name for people; matching uses the fields above
    layer: dict = field(default_factory=dict)  # "mtp": the decoder layer's shape (mtp_layer)
    # "mtp": per depth, the temperature that calibrates the layer's chance of
    # its draft (fitted on held-out rows: train/calibrate.py); empty: 1.0
    temperatures: list = field(default_factory=list)
    format: str = FORMAT
    version: int = 1


class MTPBundle(nn.Module):
    """k draft heads + CLP, and optionally the gate and head 0 baselines."""

    def __init__(self, config: HeadsConfig):
        super().__init__()
        if config.k < 1:
            raise ClpError(f"k must be at least 1, got {config.k}")
        if config.design not in DESIGNS:
            raise ClpError(f"unknown head design {config.design!r}; choose from {DESIGNS}")
        self.config = config
        d, k = config.hidden_size, config.k
        block = ResBlock if config.design == "medusa" else EmbedHead
        self.heads = [] if config.design == "mtp" else [block(d) for _ in range(k)]
        if config.design == "mtp":  # one layer drafts every depth (decode/mtp_drafter.py)
            self.mtp = MTPLayer.of_shape(config.layer, d)
        self.clp = nn.Linear(d, k + 1)
        if config.lookup:
            # CLP's logits gain a row per context match length (0 = none, the
            # heads draft): a linear layer over [h, one-hot(match)].
            self.clp_context = mx.zeros((config.lookup + 1, k + 1))
        if config.gate_hidden:
            self.gate = Gate(d, k, config.gate_hidden)
        if config.head0:
            self.head0 = ResBlock(d)
        if config.draft_vocab:
            self.draft_vocab = mx.zeros((config.draft_vocab,), dtype=mx.int32)
        self._draft_slice = DraftSlice()

    def draft_ids(self, model: nn.Module, hidden: mx.array) -> mx.array:
        """Greedy draft tokens for head outputs ``hidden`` (..., d).

        With a draft vocabulary the heads choose among its tokens only: a
        (V', d) slice of the output projection instead of all of it, a
        fraction of the cost, and verification keeps the output exact anyway.
        """
        scores, ids = self._draft_scores(model, hidden)
        best = mx.argmax(scores, axis=-1)
        return best if ids is None else ids[best]

    def _draft_scores(self, model: nn.Module, hidden: mx.array):
        """Scores over the draft vocabulary (..., V') and its token ids
        (None: the whole vocabulary, the scores are the logits)."""
        if "draft_vocab" not in self:
            return backbone.project(model, hidden), None
        w = self._draft_slice.weight(model, self.draft_vocab)
        return hidden.astype(w.dtype) @ w.T, self.draft_vocab

    def set_draft_vocab(self, ids) -> None:
        """Restrict drafting to ``ids`` (sorted token ids), as training chose them."""
        self.config.draft_vocab = len(ids)
        self.draft_vocab = mx.array(ids, dtype=mx.int32)
        self._draft_slice = DraftSlice()

    @property
    def k(self) -> int:
        return self.config.k

    @property
    def uses_token_embedding(self) -> bool:
        return self.config.design != "medusa"

    def draft_hidden(self, h: mx.array, tok_emb: mx.array | None = None) -> mx.array:
        """(..., d) -> (..., k, d): every head's output, before projection.

        ``tok_emb``: for "embed", the embedding of the backbone's token t+1
        (..., d); for "chain", of the token before each head's target
        (..., k, d), as training knows them (teacher forcing).
        """
        if self.config.design == "chain":
            outs = [head(h, tok_emb[..., i, :]) for i, head in enumerate(self.heads)]
        elif self.uses_token_embedding:
            outs = [head(h, tok_emb) for head in self.heads]
        else:
            outs = [head(h) for head in self.heads]
        return mx.stack(outs, axis=-2)

    def draft(self, model: nn.Module, h: mx.array, b: mx.array, choose=None):
        """Drafts (rows, k) from hidden states ``h`` (rows, d) and the
        backbone's tokens t+1 ``b`` (rows,), and their logits (rows, k, V).

        ``choose=None`` drafts greedily through the draft vocabulary (logits
        None); otherwise ``choose(logits)`` picks each draft from the full
        distribution. "chain" heads draft in turn, each seeing the previous
        draft (EAGLE's and FastMTP's recursion); the others in parallel.
        """
        if self.config.design != "chain":
            out = self.draft_hidden(
                h, backbone.embed(model, b) if self.uses_token_embedding else None
            )
            if choose is None:
                return self.draft_ids(model, out), None
            logits = backbone.project(model, out)
            return choose(logits), logits
        tokens, logits, prev = [], [], b
        for head in self.heads:
            out = head(h, backbone.embed(model, prev))
            if choose is None:
                prev = self.draft_ids(model, out)
            else:
                logits.append(backbone.project(model, out))
                prev = choose(logits[-1])
            tokens.append(prev)
        return mx.stack(tokens, axis=-1), mx.stack(logits, axis=-2) if logits else None

    def draft_branches(self, model: nn.Module, h: mx.array, b: mx.array, width: int) -> mx.array:
        """Greedy drafts of ``width`` branches (width, k) from one hidden
        state ``h`` (1, d) and backbone token ``b`` (1,): head 1's ``width``
        best tokens, best first, each continued by the later heads ("chain"
        heads see their branch's previous draft; the others draft the same
        continuation for every branch). Branch 0 is :meth:`draft`'s."""
        if self.config.design == "chain":
            first = self.heads[0](h, backbone.embed(model, b))
        else:
            emb = backbone.embed(model, b) if self.uses_token_embedding else None
            out = self.draft_hidden(h, emb)[0]  # (k, d)
            first = out[:1]
        scores, ids = self._draft_scores(model, first)
        top = mx.argmax(scores, axis=-1) if width == 1 else mx.argsort(-scores[0])[:width]
        prev = top if ids is None else ids[top]
        width = prev.shape[0]  # a draft vocabulary may hold fewer tokens than branches
        if self.k == 1:
            return prev[:, None]
        if self.config.design != "chain":
            rest = self.draft_ids(model, out[1:])  # (k-1,)
            return mx.concatenate([prev[:, None], mx.broadcast_to(rest, (width, self.k - 1))], 1)
        hs, tokens = mx.broadcast_to(h, (width, h.shape[-1])), [prev]
        for head in self.heads[1:]:
            prev = self.draft_ids(model, head(hs, backbone.embed(model, prev)))
            tokens.append(prev)
        return mx.stack(tokens, axis=-1)

    def use_context(self, max_ngram: int) -> None:
        """Draft from the context when it has a match (:mod:`clp_mlx.lookup`);
        CLP's context rows start at zero and are fitted with CLP."""
        self.config.lookup = max_ngram
        if max_ngram:
            self.clp_context = mx.zeros((max_ngram + 1, self.k + 1), dtype=self.clp.weight.dtype)
        elif "clp_context" in self:
            del self["clp_context"]

    def clp_logits(self, h: mx.array, match=None) -> mx.array:
        """CLP's scores for accepting 0..k drafts; ``match``: the length of
        the context match the drafts were copied from (0 or None: the
        heads'), when the bundle uses context drafts."""
        if self.config.clp_norm:
            # Qwen2.5's final hidden rows vary in length by 10x and more; a
            # linear layer on raw rows overfits the few held-out positions.
            h = h * mx.rsqrt(mx.mean(mx.square(h), axis=-1, keepdims=True) + 1e-6)
        logits = self.clp(h)
        if "clp_context" in self:  # no match given: the heads' drafts, row 0
            logits = logits + self.clp_context[0 if match is None else match]
        return logits

    def clp_length(self, h: mx.array, match=None, threshold: float | None = None) -> mx.array:
        """CLP's choice of how many drafts to accept, 0..k: its most likely
        run length (the paper), or with ``threshold`` the longest n with
        P(run >= n) >= threshold."""
        return accept_count(self.clp_logits(h, match), threshold)

    def gate_length(self, h: mx.array, threshold: float = 0.5) -> mx.array:
        """Longest run of heads whose gate probability clears ``threshold``."""
        if "gate" not in self:
            raise ClpError("these heads have no gate baseline (train it first)")
        ok = mx.sigmoid(self.gate(h)) > threshold
        return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=-1), axis=-1)

    def clp_param_count(self) -> int:
        return sum(p.size for _, p in tree_flatten(self.clp.parameters()))
