"""Tiny random Qwen2 models and helpers shared by the tests (no downloads)."""

import mlx.core as mx
import pytest
from mlx_lm.models import qwen2

import clp_mlx  # noqa: F401  (loads OpenBLAS before mlx, as users get it)
from clp_mlx.heads import init_heads


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
