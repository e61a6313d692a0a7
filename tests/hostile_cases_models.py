"""Hostile models (class 3): broken MLX folders, Hugging Face folders and GGUF files,
given to generate or the converter; each must end in one ``error:`` line."""

from __future__ import annotations

import json

import mlx.core as mx
from hostile_cases_base import (
    CONVERT,
    GEN,
    Inputs,
    byte_flips,
    edit_json,
    flip,
    gen,
    header_end,
    hf_folder_case,
    json_values,
    link,
    put,
    truncate,
)
from hostile_inputs import Batch, examples
from hypothesis import strategies as st

ST = "model.safetensors"
INDEX = f"{ST}.index.json"
# fmt: off
BAD_CONFIG_FILES = [  # MLX config.json texts
    ("broken", "{"), ("list", "[]"), ("empty-object", "{}"), ("null", "null"), ("number", "7"),
    ("empty-file", ""), ("not-utf8", b"\xff\xfe{}"),
    ("foreign", '{"model_type": "bert", "architectures": ["BertModel"]}'),
]
BAD_CONFIGS = [  # MLX config.json fields
    ("llama", {"model_type": "llama"}), ("zero-heads", {"num_attention_heads": 0}),
    ("zero-kv-heads", {"num_key_value_heads": 0}), ("hidden-65", {"hidden_size": 65}),
    ("vocab-0", {"vocab_size": 0}), ("hidden-string", {"hidden_size": "64"}),
]
CONFIG_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "intermediate_size", "rms_norm_eps",
                 "rope_theta", "tie_word_embeddings", "max_position_embeddings", "rope_scaling",
                 "model_type"]
HF_CONFIG_FILES = [("list", "[]"), ("empty-object", "{}"), ("null", "null"), ("broken", "{")]
HF_CONFIGS = [  # Hugging Face config.json fields
    ("zero-heads", {"num_attention_heads": 0}), ("zero-kv-heads", {"num_key_value_heads": 0}),
    ("zero-layers", {"num_hidden_layers": 0}), ("hidden-65", {"hidden_size": 65}),
    ("vocab-0", {"vocab_size": 0}), ("intermediate-negative", {"intermediate_size": -1}),
    ("hidden-string", {"hidden_size": "64"}), ("kv-heads-3", {"num_key_value_heads": 3}),
    ("rope-scaling-string", {"rope_scaling": "x"}), ("heads-list", {"num_attention_heads": [4]}),
]
# fmt: on


def model_folders(batch: Batch, s: Inputs) -> None:
    """Broken MLX model folders given to generate."""

    def case(name, change, expect=(1,)):
        c = batch.new(f"model/{name}", "3")
        m = link(s.model, c.inp / "model")
        change(m)
        gen(c, m, expect=expect)

    def config(**changes):
        return lambda m: edit_json(m / "config.json", **changes)

    for name, text in BAD_CONFIG_FILES:
        case(f"config-{name}", lambda m, t=text: put(m / "config.json", t))
    for name, change in BAD_CONFIGS:
        case(f"config-{name}", config(**change))
    for i, value in enumerate(examples(json_values, len(CONFIG_FIELDS))):  # one a field
        key = CONFIG_FIELDS[i]
        case(f"config-field-{key}-{i}", config(**{key: value}), expect=(0, 1))
    weights = s.model / ST
    case("weights-missing", lambda m: (m / ST).unlink())
    case("weights-and-index-missing", lambda m: [(m / n).unlink() for n in (ST, INDEX)])
    for cut in [0, 8, 100] + examples(st.integers(9, weights.stat().st_size - 1), 3):
        case(f"weights-truncated-{cut}", lambda m, n=cut: truncate(m / ST, n))
    huge = (2**62).to_bytes(8, "little") + weights.read_bytes()[8:]
    case("weights-header-length-huge", lambda m: put(m / ST, huge))
    for i, edits in enumerate(examples(byte_flips(8, header_end(weights) - 1), 3)):
        case(f"weights-header-bytes-{i}", lambda m, e=edits: flip(m / ST, e), expect=(0, 1))
    case("tokenizer-missing", lambda m: (m / "tokenizer.json").unlink())
    case("tokenizer-truncated", lambda m: truncate(m / "tokenizer.json", 50))
    case("tokenizer-config-list", lambda m: put(m / "tokenizer_config.json", "[]"), expect=(0, 1))
    c = batch.new("model/text-file-named-gguf", "3")
    gen(c, put(c.inp / "x.gguf", "not a gguf file\n"))


def hf_configs(batch: Batch, s: Inputs) -> None:
    def case(name, path, change, **kw):  # change(file) on the folder's `path`
        hf_folder_case(batch, s, f"hf/{name}", lambda c, src: change(src / path), **kw)

    def fields(**changes):
        return lambda p: edit_json(p, **changes)

    for name, text in HF_CONFIG_FILES:
        case(f"config-{name}", "config.json", lambda p, t=text: put(p, t))
    for name, change in HF_CONFIGS:
        case(f"config-{name}", "config.json", fields(**change))
    case("generate-zero-heads", "config.json", fields(num_attention_heads=0), via=GEN)
    listed = json.dumps({"weight_map": sorted(mx.load(str(s.hf / ST)))})
    for name, text in [("list", listed), ("broken", "{"), ("no-map", "{}")]:
        case(f"index-{name}", INDEX, lambda p, t=text: put(p, t))
    case("weights-truncated", ST, lambda p: truncate(p, 1000))
    case("tokenizer-missing", "tokenizer.json", lambda p: p.unlink())


def gguf_files(batch: Batch, s: Inputs) -> None:
    size = s.gguf.stat().st_size

    def case(name, change, expect=(1,), via=CONVERT):
        c = batch.new(f"gguf/{name}", "3")
        g = link(s.gguf, c.inp / "x.gguf")
        change(g)
        if via == GEN:
            return gen(c, g, expect=expect)
        kw = {"expect": expect, "may_change": ["in/out"] if 0 in expect else []}
        c.cli(CONVERT, "gguf", g, "-o", c.inp / "out", "--no-progress", **kw)

    for cut in [0, 3, 24] + examples(st.integers(25, size - 1), 4):
        case(f"truncated-{cut}", lambda g, n=cut: truncate(g, n))
    for i, edits in enumerate(examples(byte_flips(0, 4095), 3)):
        case(f"header-bytes-{i}", lambda g, e=edits: flip(g, e), expect=(0, 1))
    case("generate-truncated", lambda g: truncate(g, size // 2), via=GEN)
