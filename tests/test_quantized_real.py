"""The real Qwen2.5-Coder-0.5B at 4 bits, 8 bits and fp16, as ``mlx_lm.convert``
writes them: the shipped drafter is found by its weights, drafts are accepted,
and greedy verify gives mlx-lm's own tokens on the same folder.
"""

import pytest

import clp_mlx  # noqa: F401  (loads OpenBLAS before mlx)

# isort: split
from clp_mlx.api import load_with_drafter as load
from clp_mlx.api import stream_generate
from clp_mlx.errors import ClpError
from clp_mlx.sources.named import NAMED_MODELS, named_from_gguf

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
]
MAX_TOKENS = 48
# (mlx_lm.convert arguments): 4-bit and 8-bit with mlx-lm's default group size, fp16
COPIES = {
    "q4": dict(quantize=True, q_bits=4),
    "q8": dict(quantize=True, q_bits=8),
    "f16": dict(dtype="float16"),
}


@pytest.fixture(scope="module")
def fp32_folder():
    try:
        return named_from_gguf(NAMED_MODELS["qwen2.5-coder-0.5b-instruct"], "float32", False, True)
    except (ClpError, OSError) as e:  # no cached copy, and offline
        pytest.skip(f"Qwen2.5-Coder-0.5B not available offline: {e}")


@pytest.fixture(scope="module", params=list(COPIES))
def copy(request, fp32_folder, tmp_path_factory):
    from mlx_lm.convert import convert

    folder = tmp_path_factory.mktemp("copies") / request.param
    convert(str(fp32_folder), str(folder), **COPIES[request.param])
    return folder


def mlx_lm_tokens(folder, prompt):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(folder))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, text, max_tokens=MAX_TOKENS)]


def test_verify_finds_the_drafter_and_equals_mlx_lm(copy):
    # On the CPU backend float weights are cast to fp32 unless a dtype is asked
    # (backbone.load_backbone); mlx-lm keeps the folder's, and so does a Mac.
    model, tokenizer, heads = load(copy, dtype="float16" if copy.name == "f16" else None)
    assert heads is not None, "the shipped drafter was not found for these weights"
    accepted = 0
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        # Every draft fed: on a CPU a quantized pass costs ~linearly in its rows,
        # so the cost feed would feed none, and nothing would be checked.
        responses = list(
            stream_generate(
                model, tokenizer, text, heads, mode="verify", feed="all", max_tokens=MAX_TOKENS
            )
        )
        got = [r.token for r in responses if r.finish_reason != "stop"]
        want = [t for t in mlx_lm_tokens(copy, prompt) if t not in tokenizer.eos_token_ids]
        assert got == want, (copy.name, prompt)
        accepted += sum(n * c for n, c in enumerate(responses[-1].stats.accepted))
    assert accepted > 0
