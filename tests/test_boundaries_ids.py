"""Prompts, options and API arguments at the boundary: bad ones give one
ClpError before MLX sees them (an id past the embedding once read memory
beyond it, or killed the process)."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import FakeTokenizer, decode_pairs, tiny_model, write_model_folder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from clp_mlx import api
from clp_mlx.decode.config import DecodeConfig
from clp_mlx.decode.sampling import Sampling
from clp_mlx.errors import ClpError
from clp_mlx.model.heads_files import init_heads

REPO = Path(__file__).resolve().parents[1]
VOCAB = 128  # the tiny model's
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def tokens(prompt, model, heads=None, **kw):
    return [t for t, _ in decode_pairs(prompt, model, heads, max_tokens=3, **kw)]


BAD_PROMPTS = [
    [VOCAB], [VOCAB + 1], [10**9], [2**32 + 5], [2**70], [-1], [-(2**40)], [1, 2, VOCAB],
    [1.0], [True], [False, 1], ["a"], [None], [[1]], [], "text", b"ab", 5, None,
    mx.array([[1, 2]]), mx.array([1.5, 2.0]), mx.array([VOCAB], dtype=mx.int32),
    mx.array([-1], dtype=mx.int32), np.array([1, VOCAB]), np.array([0.5]),
]  # fmt: skip


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=repr)
def test_bad_prompt_ids_are_refused_by_decode(model, prompt):
    with pytest.raises(ClpError):
        tokens(prompt, model)


@pytest.mark.parametrize("prompt", [[10**9], [-1], [VOCAB], [1.5], [True], None, 3, b"x"], ids=repr)
def test_bad_prompts_are_refused_by_the_api(model, prompt):
    with pytest.raises(ClpError):
        api.generate(model, FakeTokenizer(), prompt, max_tokens=2)


def test_good_ids_of_every_kind_decode_alike(model):
    want = tokens([1, 2, 3], model)
    for same in ([np.int64(1), 2, 3], (1, 2, 3), mx.array([1, 2, 3]), np.array([1, 2, 3])):
        assert tokens(same, model) == want
    assert len(tokens([0, VOCAB - 1], model)) == 3


def test_context_drafts_check_the_context_too(model):
    heads = init_heads(model, 2)
    heads.use_context(3)
    with pytest.raises(ClpError, match="the context"):
        tokens([1, 2], model, heads, mode="verify", context=[1, 10**9])


ids = st.lists(
    st.one_of(st.integers(-(2**70), 2**70), st.integers(0, VOCAB - 1), st.booleans(), st.floats()),
    max_size=6,
)


@FAST
@given(prompt=ids)
def test_random_id_lists_decode_or_are_refused(model, prompt):
    valid = bool(prompt) and all(
        type(t) is int and 0 <= t < VOCAB for t in prompt  # noqa: E721 (bools are refused)
    )
    if valid:
        assert len(tokens(prompt, model)) == 3
    else:
        with pytest.raises(ClpError):
            tokens(prompt, model)


def test_a_prompt_longer_than_the_context_is_refused(model):
    short = tiny_model(0)
    short.args.max_position_embeddings = 8
    assert len(tokens(list(range(8)), short)) == 3
    with pytest.raises(ClpError, match="context holds 8"):
        tokens(list(range(9)), short)
    cache = make_prompt_cache(short)
    list(decode_pairs(list(range(6)), short, prompt_cache=cache, max_tokens=1))
    with pytest.raises(ClpError, match="already in the cache"):
        tokens([1, 2, 3, 4], short, prompt_cache=cache)


def test_draft_tokens_in_ar_mode_are_refused(model):
    heads = init_heads(model, 2)
    with pytest.raises(ClpError, match="mode ar"):
        DecodeConfig(mode="ar", draft_len=2).resolve(model, heads)
    with pytest.raises(ClpError, match="mode ar"):
        DecodeConfig(mode="ar", draft_len=2).resolve(model, None)
    assert DecodeConfig(draft_len=2).resolve(model, None).draft_len == 2  # copies, no heads
    assert DecodeConfig(mode="ar").resolve(model, heads).mode == "ar"
    assert DecodeConfig(draft_len=1).resolve(model, heads).draft_len == 1


BAD_OPTIONS = [
    {"max_tokens": "5"}, {"max_tokens": 2.5}, {"max_tokens": True}, {"max_tokens": 0},
    {"draft_len": "2"}, {"draft_len": 0}, {"tree": -1}, {"tree": 1.5}, {"clp_threshold": "x"},
    {"clp_threshold": float("nan")}, {"clp_threshold": 2}, {"gate_threshold": None},
    {"context_drafts": "yes"}, {"mode": "turbo"}, {"mode": ["ar"]}, {"feed": "most"},
    {"sampling": 0.5},
]  # fmt: skip
BAD_SAMPLING = [
    {"temp": "hot"}, {"temp": -1}, {"temp": float("nan")}, {"temp": float("inf")},
    {"top_p": 0}, {"top_p": None}, {"top_k": -1}, {"top_k": 2.0}, {"min_p": 1},
    {"seed": -1}, {"seed": 2**64}, {"seed": 1.5}, {"seed": "0"},
]  # fmt: skip


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=repr)
def test_bad_decode_options_are_refused(options):
    with pytest.raises(ClpError):
        DecodeConfig(**options)


@pytest.mark.parametrize("options", BAD_SAMPLING, ids=repr)
def test_bad_sampling_options_are_refused(options):
    with pytest.raises(ClpError):
        Sampling(**options)


def test_api_arguments_are_checked(model):
    with pytest.raises(ClpError, match="unknown option"):
        api.generate(model, FakeTokenizer(), [1, 2], temperature=0.5)
    with pytest.raises(ClpError, match="heads must be"):
        api.generate(model, FakeTokenizer(), [1, 2], "some/heads/folder")
    with pytest.raises(ClpError, match="not valid UTF-8"):
        api.generate(model, FakeTokenizer(), "caf\udce9", max_tokens=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("ids") / "tiny", tiny_model(0))


def test_load_takes_paths_and_refuses_empty_or_odd_names(folder, monkeypatch):
    model, tokenizer, heads = api.load_with_drafter(folder)  # a Path, not only a str
    assert heads is None and model.args.vocab_size == VOCAB
    assert api.load_with_drafter(str(folder), heads="init", num_draft_tokens=2)[2].k == 2
    monkeypatch.chdir(folder)  # "" would mean this folder: refused all the same
    for model_arg in ("", "  ", 5, b"x", ["a"]):
        with pytest.raises(ClpError, match="model"):
            api.load_with_drafter(model_arg)
    for heads_arg in ("", 3):
        with pytest.raises(ClpError, match="heads"):
            api.load_with_drafter(folder, heads=heads_arg)
    with pytest.raises(ClpError, match="dtype"):
        api.load_with_drafter(folder, dtype="float8")
    for k in (0, 2.5, 10**6):
        with pytest.raises(ClpError, match="draft tokens"):
            api.load_with_drafter(folder, heads="init", num_draft_tokens=k)
    with pytest.raises(ClpError, match="seed"):
        api.load_with_drafter(folder, heads="init", seed=-1)


@FAST
@given(data=st.binary(max_size=40))
def test_random_bytes_as_a_prompt_generate_or_are_refused(folder, data):
    model, tokenizer, _ = loaded(folder)
    text = data.decode("utf-8", errors="surrogateescape")  # what argv and stdin give
    try:
        api.generate(model, tokenizer, text, max_tokens=2)
    except ClpError as e:
        assert "UTF-8" in str(e) or "empty" in str(e)
        return
    data.decode("utf-8")  # accepted: it was UTF-8


_loaded = {}


def loaded(folder):
    if folder not in _loaded:
        _loaded[folder] = api.load_with_drafter(folder)
    return _loaded[folder]


def test_damaged_pass_costs_are_measured_again(model, tmp_path):
    import clp_mlx.decode.feed as feed

    heads = init_heads(model, 2)
    for junk in ('["a"]', '{"x": "abc"}', "{bad", '{"k": [0, -1]}', '{"k": [null]}'):
        costs = feed._costs_file()
        costs.write_text(junk.replace('"k"', json.dumps(feed._setup_key(model))))
        feed.forget_measured()
        assert len(tokens([1, 2], model, heads, mode="verify", feed="cost")) == 3


def test_huge_ids_in_a_subprocess_end_in_one_error(folder):
    """generate(model, tokenizer, [10**9]) once died of SIGSEGV."""
    code = (
        "import clp_mlx\nfrom clp_mlx.api import load, generate\nfrom clp_mlx.errors import ClpError\n"
        f"m, t = load({str(folder)!r})\n"
        "for p in ([10**9], [-1], [2**40], [128]):\n"
        "    try:\n        generate(m, t, p, max_tokens=2)\n"
        "    except ClpError as e:\n        print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused") == 4
