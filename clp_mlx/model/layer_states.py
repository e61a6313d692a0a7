"""The backbone's earlier layers' states, beside the final one a pass returns.

EAGLE-3's draft head reads a low, a middle and a high layer of the backbone;
the MTP layer can read the states after ``n`` of its decoder layers for some
``n`` besides the last (``train_mtp --side``). A layer records what it outputs
by becoming, for as long as it records, an instance of a subclass of its own
class whose call also keeps the output: the model's tree, its weights and
their names stay as they are (a wrapping module would rename them).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.nn as nn

from ..errors import ClpError


def _record(layer: nn.Module, sink: list, last_only: bool) -> None:
    base = type(layer)

    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        if last_only:
            sink.clear()
        sink.append(out)
        return out

    attrs = {"__call__": __call__, "_clp_sink": sink, "_clp_base": base, "_clp_last": last_only}
    layer.__class__ = type(f"Recording{base.__name__}", (base,), attrs)


def _checked(model: nn.Module, after: tuple[int, ...]) -> list:
    layers = model.model.layers
    if any(not 1 <= n < len(layers) for n in after):
        raise ClpError(f"layers to read must be 1 to {len(layers) - 1}, got {list(after)}")
    return layers


@contextmanager
def layer_outputs(model: nn.Module, after: tuple[int, ...]):
    """While open, every pass appends to ``got[n]`` (the dict it yields) the
    residual stream after the first ``n`` decoder layers, for each ``n`` in
    ``after`` (1 .. layers - 1)."""
    layers = _checked(model, after)
    got = {n: [] for n in after}
    for n in after:
        _record(layers[n - 1], got[n], last_only=False)
    try:
        yield got
    finally:
        for n in after:
            layers[n - 1].__class__ = type(layers[n - 1])._clp_base


def watch_layers(model: nn.Module, after: tuple[int, ...]) -> dict[int, list]:
    """From now on, keep the latest pass's residual stream after the first
    ``n`` decoder layers, for each ``n`` in ``after``: ``got[n][-1]`` (a lazy
    array of that pass, (B, L, d)). For a drafter that reads them while
    decoding; a layer keeps recording, for every later caller alike."""
    layers, got = _checked(model, after), {}
    for n in after:
        if not getattr(type(layers[n - 1]), "_clp_last", False):
            _record(layers[n - 1], [], last_only=True)
        got[n] = type(layers[n - 1])._clp_sink
    return got
