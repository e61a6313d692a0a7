"""Self-distilled training data for a drafter: the backbone's own greedy text
with its final hidden states at every position, in resumable shards.

Each row is a prompt followed by ``new_tokens`` tokens the backbone chose
greedily, with the final-norm hidden state of every position (fp16). A
drafter trained on these rows learns what greedy decoding (and so verify)
will actually write: at every generated position the text and the
backbone's choice agree (see :func:`clp_mlx.train.features.continue_greedily`).

Prompts (:mod:`.selfdistill_prompts`, :mod:`.selfdistill_magpie`) are numbered;
shard ``j`` holds prompt indices ``j * S`` to ``(j + 1) * S``, so the work
splits over processes by shard (``part = (i, n)``: shards with ``j % n ==
i``) and every shard is made the same way whoever makes it: seeds are per
prompt, batches are cut within a shard. A deterministic share of prompts,
chosen by a hash of the prompt's tokens, goes to held-out folders instead.
Disk layout, checksums and resuming: :mod:`.selfdistill_store`.

Hidden states are taken from the decoding passes themselves (the prefill,
then each step's pass over the token just chosen, plus one pass for the last
token), not from a second teacher-forced pass: no extra work, and exactly
the states decoding had.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import ClpError
from ..model import backbone
from ..model.layer_states import layer_outputs
from . import selfdistill_store as store
from .selfdistill_magpie import asked_prompts, inputs_digest, magpie_prompts
from .selfdistill_prompts import text_prompts
from .selfdistill_sampled import inputs_digest as sampled_digest
from .selfdistill_sampled import sampled_prompts

KINDS = ("wikitext", "code", "magpie", "sampled")
FORMAT = "clp-mlx self-distilled rows 1"
# What must match for a restart to reuse a folder's shards. The model's
# path and the data paths are recorded but not compared: the same weights
# or text moved elsewhere make the same data.
COMPARED = ("format", "settings", "backbone", "inputs")


@dataclass(frozen=True)
class Settings:
    """What a run makes. For magpie and sampled, ``prompt_tokens`` caps what is sampled;
    ``start`` is what sampled openings continue."""

    kind: str
    prompts: int
    prompt_tokens: int = 32
    new_tokens: int = 96
    batch: int = 16
    shard_size: int = 128
    heldout: float = 0.02
    seed: int = 0
    dtype: str = "float32"
    side_layers: tuple[int, ...] = ()  # earlier layers' states kept too (after n layers)
    start: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ClpError(f"unknown kind {self.kind!r}; choose from {', '.join(KINDS)}")
        for name in ("prompts", "prompt_tokens", "new_tokens", "batch", "shard_size"):
            if getattr(self, name) < 1:
                raise ClpError(f"--{name.replace('_', '-')} must be 1 or more")
        if not 0 <= self.heldout <= 1:  # 1: an evaluation-only folder
            raise ClpError(f"--heldout must be in [0, 1], got {self.heldout}")
        if self.kind == "sampled" and not self.start:
            raise ClpError("--kind sampled needs --start TEXT: the text its openings continue")
        if self.start and self.kind != "sampled":
            raise ClpError(f"--start is for --kind sampled, not {self.kind}")
        if len(set(self.side_layers)) != len(self.side_layers):
            raise ClpError(f"--side-layers repeats a layer: {list(self.side_layers)}")

    def record(self) -> dict:
        """The settings as a manifest records them (no side_layers or start when
        none, as before they existed)."""
        out = asdict(self)
        out["side_layers"] = list(self.side_layers)
        for name in ("side_layers", "start"):
            if not out[name]:
                del out[name]
        return out

    @property
    def shards(self) -> int:
        return math.ceil(self.prompts / self.shard_size)

    def indices(self, j: int) -> range:
        return range(j * self.shard_size, min(self.prompts, (j + 1) * self.shard_size))


@dataclass
class Row:
    index: int
    prompt_len: int
    tokens: np.ndarray  # (prompt_len + new_tokens,) int32
    hidden: np.ndarray  # (prompt_len + new_tokens, hidden) float16
    side: np.ndarray | None = None  # (prompt_len + new_tokens, side layers, hidden) float16


def is_heldout(prompt: np.ndarray, fraction: float) -> bool:
    """A prompt is held out when a hash of its tokens falls below ``fraction``."""
    digest = hashlib.sha256(b"clp-mlx heldout\0" + prompt.astype("<i4").tobytes()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def continue_batch(
    model, prompts: list[np.ndarray], new_tokens: int, tick=lambda n: None, side_layers=()
):
    """Greedy continuations of ``prompts`` as one batch: (tokens, hidden,
    side) per row, ``side`` the states after each of ``side_layers`` layers
    (None without them).

    Prompts of different lengths are left-padded; mlx-lm's batch cache masks
    the padding and starts each row's positions at 0, so a row's tokens and
    states are its own, up to matmul rounding.
    """
    if not side_layers:
        return _continue_batch(model, prompts, new_tokens, tick, None)
    with layer_outputs(model, tuple(side_layers)) as got:
        return _continue_batch(model, prompts, new_tokens, tick, got)


def _continue_batch(model, prompts, new_tokens, tick, got):
    from mlx_lm.models.cache import BatchKVCache

    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    x = np.zeros((len(prompts), width), dtype=np.int32)
    for r, p in enumerate(prompts):
        x[r, pads[r] :] = p
    cache = [BatchKVCache(pads) for _ in model.layers]
    sides = []

    def keep_side():  # the pass's earlier-layer states, (B, n, S, d)
        if got is not None:
            sides.append(mx.stack([got[n].pop() for n in got], axis=2).astype(mx.float16))

    h = model.model(mx.array(x), cache=cache)
    states = [h.astype(mx.float16)]
    keep_side()
    # A plain argmax: greedy up to near-ties, and the log-softmax mlx-lm's
    # greedy sampler adds costs ~2 ms a row on a 152k vocabulary.
    token = mx.argmax(backbone.project(model, h[:, -1:]), axis=-1)
    chosen = []
    for step in range(new_tokens):
        chosen.append(token)
        h = model.model(token, cache=cache)  # the last pass only for its hidden state
        states.append(h.astype(mx.float16))
        keep_side()
        if step + 1 < new_tokens:
            token = mx.argmax(backbone.project(model, h), axis=-1)
        mx.eval(token, states[-1], *sides[-1:])
        tick(len(prompts))
    hidden = np.array(mx.concatenate(states, axis=1))
    side = np.array(mx.concatenate(sides, axis=1)) if sides else None
    new = np.array(mx.concatenate(chosen, axis=1).astype(mx.int32))
    rows = [np.concatenate([p.astype(np.int32), new[r]]) for r, p in enumerate(prompts)]
    cut = lambda a: [None if a is None else a[r, pads[r] :] for r in range(len(prompts))]
    return rows, cut(hidden), cut(side)


def continue_rows(model, prompts, new_tokens: int, batch: int, tick, side_layers=()):
    """:class:`Row` for each (index, prompt), ``batch`` prompts per pass."""
    rows = []
    for b in range(0, len(prompts), batch):
        part = prompts[b : b + batch]
        got = continue_batch(model, [p for _, p in part], new_tokens, tick, side_layers)
        rows += [Row(i, len(p), *made) for (i, p), *made in zip(part, *got)]
    return rows


def prompt_source(model, tokenizer, settings: Settings, data: list[str]):
    """(prompts of a shard's indices, sha256 of the inputs' content)."""
    s = settings
    if s.kind == "magpie" and data:  # questions already written: answer them
        asked, digest = asked_prompts(tokenizer, data, s.prompts)
        return (lambda indices: [(i, asked[i]) for i in indices if i in asked]), digest
    if s.kind == "magpie":

        def sampled(indices):
            return magpie_prompts(
                model, tokenizer, indices, cap=s.prompt_tokens, batch=s.batch, seed=s.seed
            )

        return sampled, inputs_digest(tokenizer)
    if s.kind == "sampled":
        if data:
            raise ClpError("--kind sampled takes no --data: its openings are sampled after --start")

        def drawn(indices):
            return sampled_prompts(
                model, tokenizer, indices, start=s.start, cap=s.prompt_tokens, batch=s.batch,
                seed=s.seed,
            )  # fmt: skip

        return drawn, sampled_digest(tokenizer, s.start)
    prompts, digest = text_prompts(
        tokenizer, s.kind, data, count=s.prompts, length=s.prompt_tokens, seed=s.seed
    )
    return (lambda indices: [(i, prompts[i]) for i in indices]), digest


def distill(
    model,
    tokenizer,
    out: str | Path,
    settings: Settings,
    data: list[str] = (),
    *,
    part: tuple[int, int] = (0, 1),
    progress: bool = True,
    sources: dict | None = None,
) -> dict:
    """Make this process's shards of ``out`` that are not whole yet; a summary."""
    from tqdm import tqdm

    out = Path(out)
    layers = model.args.num_hidden_layers
    if any(not 1 <= n < layers for n in settings.side_layers):
        raise ClpError(f"--side-layers must be 1 to {layers - 1} on this model, "
                       f"got {list(settings.side_layers)}")  # fmt: skip
    prompts_of, inputs = prompt_source(model, tokenizer, settings, list(data))
    manifest = {
        "format": FORMAT,
        "settings": settings.record(),
        "backbone": backbone.signature(model)["fingerprint"],
        "inputs": inputs,
        "hidden_size": model.args.hidden_size,
        "shards": settings.shards,
        "sources": sources or {},
    }
    store.check_manifest(out, manifest, COMPARED)
    mine = [j for j in range(settings.shards) if j % part[1] == part[0]]
    todo = [j for j in mine if not _whole(out, j)]
    bar = tqdm(
        total=sum(len(settings.indices(j)) for j in todo) * settings.new_tokens,
        unit="tok",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
        desc=f"{settings.kind}: greedy tokens",
        smoothing=0.05,
    )
    made = busy = 0
    with bar:
        for j in todo:
            with store.owning(out, j) as owned:
                if not owned:  # another process is making it
                    busy += 1
                elif not store.is_complete(out, j):  # unless one made it since
                    bar.set_postfix_str(f"shard {j} of {settings.shards}")
                    _make_shard(model, out, j, prompts_of, settings, bar.update)
                    made += 1
    whole = sum(store.sidecar(out, j).is_file() for j in mine)  # verified or made above
    return {
        "shards": settings.shards,
        "mine": len(mine),
        "made": made,
        "whole": whole,
        "busy": busy,
    }


def _whole(out: Path, j: int) -> bool:
    """Shard ``j`` is whole (its leftovers removed); False too if another process holds it."""
    with store.owning(out, j) as owned:
        if owned and store.is_complete(out, j):
            store.clear_leftovers(out, j)
            return True
    return False


def _make_shard(model, out: Path, j: int, prompts_of, s: Settings, tick) -> None:
    store.clear(out, j)
    prompts = prompts_of(s.indices(j))
    tick((len(s.indices(j)) - len(prompts)) * s.new_tokens)  # indices whose every draw failed
    rows = continue_rows(model, prompts, s.new_tokens, s.batch, tick, s.side_layers)
    held = [is_heldout(r.tokens[: r.prompt_len], s.heldout) for r in rows]
    parts = {
        store.TRAIN: [r for r, h in zip(rows, held) if not h],
        store.HELD: [r for r, h in zip(rows, held) if h],
    }
    store.write_shard(out, j, parts, s.kind, s.side_layers)
