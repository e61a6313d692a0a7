"""--noise: training steps read the backbone's states with uniform noise
scaled to each state's RMS (EAGLE's feature noise); held-out checks and the
soft target read the clean states."""

import mlx.core as mx
import numpy as np
import pytest
from mtp_helpers import distilled, train_argv

from clp_mlx.cli.train_mtp import main
from clp_mlx.errors import ClpError
from clp_mlx.train import mtp_trainer
from clp_mlx.train.mtp_trainer import noisy


def test_noise_is_bounded_by_each_states_own_rms():
    """Two states of one position (the last layer's and a side layer's, 100
    times larger): each moves by at most ``amount`` times its own RMS, and
    by about that much at the most (uniform noise fills the interval)."""
    rng = np.random.default_rng(0)
    last, side = rng.normal(size=(2, 5, 16)), 100 * rng.normal(size=(2, 5, 16))
    h = mx.array(np.concatenate([last, side], axis=-1).astype(np.float32))
    out = np.array(noisy(h, 0.1, 16, mx.random.key(3)))
    for chunk, x in ((slice(0, 16), last), (slice(16, 32), side)):
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
        moved = np.abs(out[..., chunk] - x) / rms
        assert moved.max() <= 0.1 + 1e-5 and moved.max() > 0.09
        assert 0.04 < moved.mean() < 0.06  # |U(-0.1, 0.1)| averages 0.05
    again = np.array(noisy(h, 0.1, 16, mx.random.key(3)))
    assert np.array_equal(out, again)  # seeded: a resumed run draws the same noise


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return distilled(tmp_path_factory.mktemp("train_mtp_noise"))


def test_a_noisy_step_reads_noisy_states_and_the_run_changes(root, monkeypatch):
    seen = []
    loss = mtp_trainer.MTPTrainer._loss

    def spying(self, b):
        seen.append("clean" in b)
        return loss(self, b)

    monkeypatch.setattr(mtp_trainer.MTPTrainer, "_loss", spying)
    assert main(train_argv(root, "noisy", "--noise", "0.2")) == 0
    assert any(seen)  # training steps
    assert not all(seen)  # held-out checks read the clean states
    assert main(train_argv(root, "plain")) == 0
    a = mx.load(str(root / "noisy" / "drafter" / "heads.safetensors"))
    b = mx.load(str(root / "plain" / "drafter" / "heads.safetensors"))
    assert any(not mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan"])
def test_noise_out_of_range_is_one_error(root, value):
    with pytest.raises(ClpError, match="--noise must be in"):
        main(train_argv(root, "bad", "--noise", value))
