"""Tiny random Qwen2 models and helpers shared by the tests (no downloads)."""

# clp_mlx must be imported before mlx: it loads OpenBLAS, without which the
# CPU backend's matmuls are ~30x slower (and so is this test suite).
import clp_mlx  # noqa: F401

# isort: split
import mlx.core as mx
import pytest
from mlx_lm.models import qwen2

from clp_mlx.model.heads_files import init_heads


def tiny_model(
    seed: int = 0, *, vocab: int = 128, hidden: int = 64, layers: int = 2, tied: bool = True
):
    """A random Qwen2 with the real architecture (GQA, q/k/v biases, RoPE)."""
    mx.random.seed(seed)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    model = qwen2.Model(args)
    # mlx's default embedding init is small; sharpen logits so that greedy
    # choices are not decided by rounding noise.
    model.model.embed_tokens.weight = mx.random.normal((vocab, hidden)) * 2.0
    mx.eval(model.parameters())
    return model


def random_heads(model, k: int, seed: int, scale: float = 1.0, design: str = "medusa"):
    """Heads with random (adversarial) weights: their drafts are mostly wrong."""
    bundle = init_heads(model, k, design=design, seed=seed)
    mx.random.seed(seed + 1000)
    from mlx.utils import tree_flatten

    noisy = [(n, mx.random.normal(p.shape) * scale) for n, p in tree_flatten(bundle.parameters())]
    bundle.load_weights(noisy)
    mx.eval(bundle.parameters())
    return bundle


class FakeDetokenizer:
    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens, self.last_segment = [], ""

    def add_token(self, t):
        self.tokens.append(t)
        self.last_segment = f"<{t}>"

    def finalize(self):
        self.last_segment = ""


class FakeTokenizer:
    """Just enough of mlx-lm's TokenizerWrapper for stream_generate."""

    bos_token = None
    chat_template = None

    def __init__(self, eos=()):
        self.eos_token_ids = set(eos)
        self.detokenizer = FakeDetokenizer()

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 128 for c in text]


@pytest.fixture(scope="session")
def model():
    return tiny_model(0)


def write_model_folder(folder, model):
    """Save a tiny model as an mlx-lm folder with a 128-token byte tokenizer."""
    import json

    from mlx_lm.utils import save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    save_model(folder, model)
    (folder / "config.json").write_text(json.dumps(dict(model.args.__dict__)))
    alphabet = sorted(ByteLevel.alphabet())[:127]
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = 127
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(autouse=True)
def _pass_costs_in_tmp(tmp_path, monkeypatch):
    """Measured pass costs go to a test folder, never the user's model cache."""
    import clp_mlx.decode.feed as feed

    monkeypatch.setattr(feed, "_costs_file", lambda: tmp_path / "pass_costs.json")
    feed.forget_measured()


def decode_pairs(prompt, model, heads=None, *, stats=None, prompt_cache=None, context=None, **kw):
    """``(token, from_draft)`` pairs from :func:`clp_mlx.decode.loop.decode`.

    Takes the options as keywords (``num_draft_tokens`` and ``lookup`` under
    their old names too) and adds each step to ``stats`` when given. Feeds
    every draft unless ``feed`` says otherwise: what these tests were written
    for, independent of measured pass costs.
    """
    from clp_mlx.decode.config import DecodeConfig
    from clp_mlx.decode.loop import decode
    from clp_mlx.decode.steps import tokens_of

    renamed = {"num_draft_tokens": "draft_len", "lookup": "context_drafts"}
    options = {"feed": "all", **{renamed.get(k, k): v for k, v in kw.items()}}
    steps = decode(prompt, model, heads, DecodeConfig(**options), prompt_cache=prompt_cache, context=context)

    def counted():
        for step in steps:
            if stats is not None:
                stats.add(step)
            yield step

    return tokens_of(counted())


def write_tokenizer(folder, max_length: int = 512) -> None:
    """A byte-level BPE tokenizer (256 byte tokens and <|endoftext|>, id 256),
    saved as a Hugging Face folder saves it."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "model_max_length": max_length}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
