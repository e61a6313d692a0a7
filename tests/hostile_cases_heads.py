"""Hostile heads: heads files and prompt ids through the API (class 1, and 3 for a
mistyped heads.json), Medusa checkpoints and packaging through the converter."""

from __future__ import annotations

import json
import math
import os
import pickle
import zipfile
from pathlib import Path

import mlx.core as mx
from hostile_cases_base import (
    CONVERT,
    GEN,
    VOCAB,
    Inputs,
    byte_flips,
    edit_json,
    flip,
    header_end,
    json_values,
    link,
    put,
    save_st,
    truncate,
)
from hostile_inputs import Batch, examples
from hypothesis import strategies as st

ST = "heads.safetensors"
HEADS_RUNS = [
    {"prompt": "hello world", "options": {"feed": "all", "max_tokens": 5}},
    {"prompt": "hello world", "options": {"mode": "clp", "max_tokens": 5}},
]
# fmt: off
HEADS_FIELDS = ["k", "design", "hidden_size", "vocab_size", "num_layers", "probe", "gate_hidden",
                "head0", "draft_vocab", "lookup", "clp_norm", "tree_branches", "format", "version",
                "fingerprint"]
DRAFT_VOCABS = [  # (name, draft_vocab array, what loading must do)
    ("uint32-max", mx.array([2**32 - 1, 3], dtype=mx.uint32), "clp"),
    ("int64-huge", mx.array([2**40, 3], dtype=mx.int64), "clp"),
    ("float32", mx.array([1.0, 2.5], dtype=mx.float32), "clean"),
    ("int8", mx.array([1, 2], dtype=mx.int8), "clean"),
    ("bool", mx.array([True, False]), "clean"), ("2d", mx.zeros((2, 2), dtype=mx.int32), "clean"),
]
SHAPES = [  # clp.weight reshaped
    ("transposed", lambda a: a.T if a.ndim == 2 else a[None]), ("extra-axis", lambda a: a[None]),
    ("scalar", lambda a: a.reshape(-1)[0]), ("empty", lambda a: a[:0]),
    ("flat", lambda a: a.reshape(-1)),
]
NOT_AN_OBJECT = [  # whole JSON files that hold no object (or no JSON)
    ("list", "[]"), ("number", "123"), ("string", '"x"'), ("null", "null"), ("empty-object", "{}"),
    ("broken", "{"), ("empty-file", ""), ("not-utf8", b"\xff\xfe{}"),
]
BAD_FIELDS = [
    ("k", 0), ("k", -1), ("k", 2**40), ("k", "2"), ("k", 2.5), ("design", "bogus"),
    ("hidden_size", 0), ("vocab_size", 10**9), ("gate_hidden", 10**9), ("gate_hidden", -5),
    ("draft_vocab", 10**9), ("lookup", -1), ("lookup", 10**7), ("tree_branches", 0),
    ("tree_branches", 10**9), ("probe", []), ("probe", [math.nan] * 320),
]
# fmt: on


def heads_files(batch: Batch, s: Inputs) -> None:
    weights = mx.load(str(s.heads / "heads.safetensors"))
    floats = sorted(k for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating))
    st_file = s.heads / ST
    size = st_file.stat().st_size

    def case(name, cls, want, change):
        c = batch.new(f"heads/{name}", cls)
        h = link(s.heads, c.inp / "heads")
        change(h, dict(weights))
        c.api(str(s.model), str(h), runs=HEADS_RUNS, want=want)

    def arrays(h, new):
        save_st(h / "heads.safetensors", new)

    def vocab(value, count):  # this draft_vocab array, heads.json saying it holds `count`
        def change(h, w):
            arrays(h, {**w, "draft_vocab": value})
            edit_json(h / "heads.json", draft_vocab=count)

        return change

    def weight(key, make):  # the weight `key` replaced by make(old)
        return lambda h, w: arrays(h, {**w, key: make(w[key])})

    def in_file(name, change):  # change(path) on one of the heads' files
        return lambda h, w: change(h / name)

    def heads_json(**changes):
        return lambda h, w: edit_json(h / "heads.json", **changes)

    case("valid", "1", "ok", lambda h, w: None)
    ids = st.lists(
        st.integers(0, VOCAB - 1)
        | st.sampled_from([-1, -VOCAB, VOCAB, VOCAB + 1, 255, 2**31 - 1, -(2**31)])
        | st.integers(-(2**31), 2**31 - 1),
        min_size=1,
        max_size=24,
    ).filter(lambda v: any(not 0 <= i < VOCAB for i in v))
    for i, v in enumerate(examples(ids, 8)):
        far = mx.array(v, dtype=mx.int32)
        case(f"draft-vocab-out-of-range-{i}", "1", "clp", vocab(far, len(v)))
    for name, value, want in DRAFT_VOCABS:
        case(f"draft-vocab-{name}", "1", want, vocab(value, value.shape[0]))
    case("draft-vocab-count-mismatch", "1", "clp", heads_json(draft_vocab=10))
    case("draft-vocab-count-negative", "1", "clean", heads_json(draft_vocab=-3))
    bad = st.sampled_from([math.nan, math.inf, -math.inf, 3e38])
    for key, value in examples(st.tuples(st.sampled_from(floats), bad), 5):
        full = weight(key, lambda a, v=value: mx.full(a.shape, v, a.dtype))
        case(f"weight-{value}-{key}", "1", "clean", full)
    kinds = ["int32", "int8", "uint8", "bool_", "complex64", "float16", "bfloat16", "int64"]
    for key, dtype in examples(st.tuples(st.sampled_from(floats), st.sampled_from(kinds)), 6):
        cast = weight(key, lambda a, d=dtype: a.astype(getattr(mx, d)))
        case(f"dtype-{dtype}-{key}", "1", "clean", cast)
    for name, change in SHAPES:
        case(f"shape-{name}", "1", "clp", weight("clp.weight", change))
    no_bias = {k: v for k, v in weights.items() if k != "clp.bias"}
    case("missing-weight", "1", "clp", lambda h, w: arrays(h, no_bias))
    case("unknown-weight", "1", "clean", lambda h, w: arrays(h, {**w, "evil.weight": mx.zeros(3)}))
    for cut in examples(st.integers(0, size - 1), 6):
        case(f"truncated-{cut}", "1", "clp", in_file(ST, lambda p, n=cut: truncate(p, n)))
    for i, edits in enumerate(examples(byte_flips(0, header_end(st_file) - 1), 6)):
        case(f"header-bytes-{i}", "1", "clean", in_file(ST, lambda p, e=edits: flip(p, e)))
    for name, text in NOT_AN_OBJECT:
        case(f"json-{name}", "3", "clp", in_file("heads.json", lambda p, t=text: put(p, t)))
    for key, value in BAD_FIELDS:
        case(f"json-{key}-{json.dumps(value)[:12]}", "3", "clean", heads_json(**{key: value}))
    for i, value in enumerate(examples(json_values, 2 * len(HEADS_FIELDS))):  # two a field
        key = HEADS_FIELDS[i % len(HEADS_FIELDS)]
        case(f"json-field-{key}-{i}", "3", "clean", heads_json(**{key: value}))

    far = vocab(mx.array([0, 2**31 - 1], dtype=mx.int32), 2)
    for name, change in [  # the same through the command: one error line, no death
        ("draft-vocab-out-of-range", lambda h: far(h, weights)),
        ("truncated", lambda h: truncate(h / "heads.safetensors", size // 2)),
    ]:
        c = batch.new(f"heads/generate-{name}", "1")
        change(link(s.heads, c.inp / "heads"))
        c.cli(GEN, "--model", s.model, "--heads", c.inp / "heads", "-p", "hello", "-m", "4")


def prompt_ids(batch: Batch, s: Inputs) -> None:
    """Id lists into generate(): out of the vocabulary or not ids at all must raise ClpError."""
    hostile = (
        st.integers(0, VOCAB - 1)
        | st.integers(-(2**70), 2**70)
        | st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31, 2**32, 2**32 + 5, 2**63, 2**64])
        | st.floats().filter(lambda f: not f.is_integer())
        | st.text(max_size=2)
        | st.none()
    )
    fixed = [[], [VOCAB], [-1], [2**31], [2**40], [1.5], ["a"], [None], [[1, 2]]]
    fixed += [[1, 2, 2**32 + 1], [VOCAB - 1, 0]]
    for i, ids in enumerate(fixed + examples(st.lists(hostile, max_size=5), 16)):
        valid = bool(ids) and all(type(t) is int and 0 <= t < VOCAB for t in ids)
        mode = ("verify", "ar", "clp")[i % 3]
        c = batch.new(f"ids/{i}-{mode}-{json.dumps(ids)[:40]}", "1")
        runs = [{"prompt": ids, "options": {"mode": mode}}]
        c.api(str(s.model), str(s.heads), runs=runs, reuse=True, want="ok" if valid else "clp")


class _Evil:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _evil_checkpoint(path: Path, payload) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("evil/data.pkl", pickle.dumps(payload, protocol=2))
        zf.writestr("evil/byteorder", "little")
        zf.writestr("evil/version", "3\n")
    return path


def torch_heads(batch: Batch, s: Inputs) -> None:
    from test_torch_heads import medusa_state

    from clp_mlx.sources.torch_zip import save_torch_file

    def case(name, make, cls="3", model=None):
        c = batch.new(f"torch/{name}", cls)
        pt = make(c)
        c.cli(CONVERT, "heads-from-torch", pt, "--model", model or s.model, "-o", c.inp / "out")

    def pt(data):  # the case's x.pt, holding `data`
        return lambda c: put(c.inp / "x.pt", data)

    def wrong_shapes(c):
        state = {k: v[:32, :32] if v.ndim == 2 else v[:32] for k, v in medusa_state(2).items()}
        save_torch_file(c.inp / "x.pt", state)
        return c.inp / "x.pt"

    def evil(wrap):  # a checkpoint whose unpickling would run `touch in/PWNED`
        return lambda c: _evil_checkpoint(c.inp / "x.pt", wrap(_Evil(f"touch {c.inp / 'PWNED'}")))

    size = s.torch_heads.stat().st_size
    for cut in [10] + examples(st.integers(11, size - 1), 2):
        case(f"truncated-{cut}", pt(s.torch_heads.read_bytes()[:cut]))
    case("random-bytes", pt(bytes(range(256)) * 4))
    case("zip-magic-then-junk", pt(b"PK\x03\x04" + b"junk" * 50))
    case("wrong-shapes", wrong_shapes)
    case("safetensors-truncated", lambda c: put(c.inp / "x.safetensors", b"\x10" + bytes(7) + b"{"))
    nothing = s.text.parent / "nothing"
    case("model-not-a-model", lambda c: link(s.torch_heads, c.inp / "x.pt"), model=nothing)
    case("pickle-runs-os-system", evil(lambda payload: payload), cls="7")
    case("pickle-nested-os-system", evil(lambda payload: {"0.0.linear.weight": payload}), cls="7")


def heads_to_package(batch: Batch, s: Inputs) -> None:
    def case(name, change, model="qwen2.5-coder-0.5b-instruct"):
        c = batch.new(f"package/{name}", "3")
        h = link(s.heads, c.inp / "heads")
        put(h / "training.json", json.dumps({"command": "python -m clp_mlx.train", "history": []}))
        change(h)
        c.cli(CONVERT, "heads-to-package", h, model)
        c.spec["shipped"] = str(c.inp / "shipped")  # never the package's own folder

    case("no-training-report", lambda h: (h / "training.json").unlink())
    case("weights-truncated", lambda h: truncate(h / "heads.safetensors", 100))
    case("weights-not-safetensors", lambda h: put(h / "heads.safetensors", "hello"))
    case("report-broken-json", lambda h: put(h / "training.json", "{"))
    case("model-name-escapes", lambda h: None, model="../../escape")
