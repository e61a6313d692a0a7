"""The Python API in mlx-lm's shape: mlx-lm's README examples run with the
import swapped and give mlx-lm's tokens; load() returns two values with the
drafter riding on the model; responses carry mlx-lm's fields."""

import dataclasses
import json

import mlx.core as mx
import pytest
from conftest import tiny_model, write_model_folder
from mlx_lm.generate import GenerationResponse

from clp_mlx import api
from clp_mlx.errors import ClpError
from clp_mlx.sample_utils import make_sampler

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

# mlx-lm's README (Python API), verbatim but for the repo and max_tokens.
README_GENERATE = """
from mlx_lm import load, generate

model, tokenizer = load(REPO)

prompt = "Write a story about Einstein"

messages = [{"role": "user", "content": prompt}]
prompt = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True
)

text = generate(model, tokenizer, prompt=prompt, verbose=True, max_tokens=24)
"""
README_STREAM = """
from mlx_lm import load, stream_generate

repo = REPO
model, tokenizer = load(repo)

prompt = "Write a story about Einstein"

messages = [{"role": "user", "content": prompt}]
prompt = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True
)

for response in stream_generate(model, tokenizer, prompt, max_tokens=24):
    print(response.text, end="", flush=True)
print()
"""
README_SAMPLER = """
from mlx_lm import load, generate
from mlx_lm.sample_utils import make_sampler

model, tokenizer = load(REPO)
sampler = make_sampler(temp=0.0)
text = generate(model, tokenizer, prompt="hello", sampler=sampler, max_tokens=24)
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = write_model_folder(tmp_path_factory.mktemp("api") / "tiny", tiny_model(0))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def run_example(code, folder, swap, capsys):
    if swap:
        code = code.replace("from mlx_lm import", "from clp_mlx import")
        code = code.replace("from mlx_lm.sample_utils import", "from clp_mlx.sample_utils import")
    names = {"REPO": str(folder)}
    exec(code, names)
    return names, capsys.readouterr().out


@pytest.mark.parametrize("example", [README_GENERATE, README_STREAM, README_SAMPLER])
def test_mlx_lm_readme_examples_give_mlx_lms_tokens(example, folder, capsys):
    theirs, their_out = run_example(example, folder, False, capsys)
    ours, our_out = run_example(example, folder, True, capsys)
    assert ours["model"].__class__ is theirs["model"].__class__
    if "text" in theirs:
        assert ours["text"] == theirs["text"] and len(ours["text"]) > 0
    else:
        assert our_out == their_out and len(our_out.strip()) > 0
    if "verbose=True" in example:  # mlx-lm's frame around the text and its statistics
        assert our_out.startswith("=" * 10) and "Generation: " in our_out


def test_load_returns_two_values_and_the_drafter_rides_on_the_model(folder):
    model, tokenizer = api.load(folder, drafter="init")
    assert api.drafter_of(model) is not None
    assert "_clp_drafter" not in dict(model.parameters())  # no parameter of the model
    last = list(api.stream_generate(model, tokenizer, "ab", max_tokens=6))[-1]
    assert last.stats.mode == "verify" and last.stats.k == api.drafter_of(model).k
    # explicit heads still win: None means none at all
    assert list(api.stream_generate(model, tokenizer, "ab", None, max_tokens=4))[-1].stats.k > 0
    plain, _ = api.load(folder)
    assert api.drafter_of(plain) is None  # tiny random weights: no drafter made for them
    _, _, config = api.load(folder, return_config=True)
    assert config["vocab_size"] == 128
    for bad in (dict(adapter_path="x"), dict(tokenizer_config={"a": 1}), dict(revision="main")):
        with pytest.raises(ClpError, match="not supported"):
            api.load(folder, **bad)


def test_responses_have_mlx_lms_fields(folder):
    model, tokenizer = api.load(folder)
    theirs = {f.name for f in dataclasses.fields(GenerationResponse)}
    ours = {f.name for f in dataclasses.fields(api.Response)}
    assert theirs <= ours, theirs - ours
    last = list(api.stream_generate(model, tokenizer, "ab", max_tokens=3))[-1]
    assert last.finish_reason == "length" and last.generation_tokens == 3


def test_mlx_lms_samplers_and_processors_run_mlx_lms_generation(folder):
    from mlx_lm import generate as mlx_generate
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    model, tokenizer = api.load(folder)
    processors = make_logits_processors(repetition_penalty=1.5)
    kw = dict(max_tokens=12, logits_processors=processors)
    want = mlx_generate(model, tokenizer, "abab", **kw)
    assert api.generate(model, tokenizer, "abab", **kw) == want
    mx.random.seed(3)
    want = mlx_generate(model, tokenizer, "ab", max_tokens=12, sampler=mlx_make_sampler(1.0))
    mx.random.seed(3)
    responses = list(
        api.stream_generate(model, tokenizer, "ab", max_tokens=12, sampler=mlx_make_sampler(1.0))
    )
    assert "".join(r.text for r in responses) == want
    assert responses[-1].stats.mode == "mlx-lm" and responses[0].logprobs is not None
    with pytest.raises(ClpError, match="mode"):
        list(api.stream_generate(model, tokenizer, "ab", mode="verify", logits_processors=processors))
    # a draft model, with mlx-lm's num_draft_tokens: mlx-lm's speculative decoding
    want = mlx_generate(model, tokenizer, "ab", max_tokens=8, draft_model=model, num_draft_tokens=2)
    got = list(api.stream_generate(model, tokenizer, "ab", max_tokens=8, draft_model=model,
                                   num_draft_tokens=2))  # fmt: skip
    assert "".join(r.text for r in got) == want and any(r.from_draft for r in got)


def test_our_sampler_keeps_verify_and_refuses_what_it_cannot_do(folder):
    model, tokenizer = api.load(folder, drafter="init")
    sampler = make_sampler(temp=0.8, top_p=0.9, seed=5)
    once = list(api.stream_generate(model, tokenizer, "ab", max_tokens=10, sampler=sampler))
    again = api.generate(model, tokenizer, "ab", max_tokens=10, sampler=make_sampler(0.8, 0.9, seed=5))
    assert once[-1].stats.mode == "verify" and "".join(r.text for r in once) == again
    assert api.generate(model, tokenizer, "ab", max_tokens=8, sampler=make_sampler()) == (
        api.generate(model, tokenizer, "ab", max_tokens=8, mode="ar")
    )
    with pytest.raises(ClpError, match="XTC"):
        make_sampler(0.5, xtc_probability=0.1)
    with pytest.raises(ClpError, match="min_tokens_to_keep"):
        make_sampler(0.5, min_p=0.1, min_tokens_to_keep=2)


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_are_the_backbones_as_mlx_lm_gives_them(folder, sampled):
    from mlx_lm import stream_generate as mlx_stream

    model, tokenizer = api.load(folder, drafter="init")
    kw = {"sampler": make_sampler(0.9, seed=1)} if sampled else {}
    ours = list(api.stream_generate(model, tokenizer, "abcabc", max_tokens=16, **kw))
    assert ours[-1].stats.tokens_per_step > 1 or sampled  # drafts were committed
    tokens = [r.token for r in ours]
    # mlx-lm's logprobs for the same tokens: feed them one by one (greedy: it writes them)
    theirs = list(mlx_stream(model, tokenizer, "abcabc", max_tokens=16)) if not sampled else None
    for i, r in enumerate(ours):
        lp = r.logprobs
        assert lp.shape == (model.args.vocab_size,)
        assert abs(mx.logsumexp(lp).item()) < 1e-4  # a distribution
        if theirs is not None:
            assert theirs[i].token == tokens[i]
            assert mx.allclose(lp, theirs[i].logprobs, atol=1e-4).item()
            assert mx.argmax(lp).item() == tokens[i]
    # and they are the backbone's at each position, as one pass over the whole text gives them
    ids = tokenizer.encode("abcabc")
    assert len(ids) == ours[0].prompt_tokens
    logits = model(mx.array(ids + tokens)[None])[0]
    want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for i, r in enumerate(ours):
        assert mx.allclose(r.logprobs, want[len(ids) - 1 + i], atol=1e-3).item(), i
    unchecked = list(api.stream_generate(model, tokenizer, "ab", max_tokens=4, mode="fixed"))
    assert all(r.logprobs is None for r in unchecked)
