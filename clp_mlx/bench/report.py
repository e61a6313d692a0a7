"""The benchmark's output: markdown table, JSON with the environment, plots.

Files are written whole or not at all, through :func:`clp_mlx.paths.write_bytes`
(a temporary sibling renamed over the target).
"""

from __future__ import annotations

import io
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from ..native import status as native_status
from ..paths import write_bytes

PLOTS = ("speedup-vs-quality.png", "accepted-lengths.png")


def markdown(table: dict) -> str:
    head = (
        "| method | speed-up vs ar (min-max) | decode tok/s | first token s | τ | repetition "
        "| identical to ar | perplexity | peak memory GB |"
    )
    lines = [head, "| --- |" + " ---: |" * 8]
    for m, r in table.items():
        lines.append(
            f"| {m} | {r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) "
            f"| {r['decode_tps']:.2f} | {r['first_token_s']:.3f} | {r['tokens_per_pass']:.2f} "
            f"| {r['repetition']:.4f} | {r['identical_to_ar']:.0%} | {r['perplexity']:.2f} "
            f"| {r['peak_memory_gb']:.2f} |"
        )
    prefill = next(iter(table.values()))["prefill_s"] if table else 0.0
    lines.append(f"\nPrefill, once per prompt for all methods (median): {prefill:.3f} s")
    return "\n".join(lines)


# -- environment --------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def blas_in_use() -> str:
    """What multiplies fp32 matrices on the CPU (see :func:`clp_mlx.native.status`)."""
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    native = native_status()
    if native.loaded:
        core = f", {native.core} kernels" if native.core else ""
        return f"openblas (preloaded{core}); few-row kernel {native.note}"
    if os.environ.get("CLP_MLX_NO_OPENBLAS"):
        return "bundled reference BLAS (OpenBLAS preload disabled by CLP_MLX_NO_OPENBLAS)"
    return "bundled reference BLAS (OpenBLAS not found)"


def environment() -> dict:
    import mlx.core as mx

    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_backend": next(
            (f"{d} {_version(d)}" for d in ("mlx-metal", "mlx-cuda", "mlx-cpu") if _version(d)),
            None,
        ),
        "mlx_lm": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
    }


def weights_dtype(model) -> str:
    """The dtypes of a model's parameters, e.g. 'float16' or 'float16, uint32' (quantized)."""
    from mlx.utils import tree_flatten

    kinds = {str(p.dtype).removeprefix("mlx.core.") for _, p in tree_flatten(model.parameters())}
    return ", ".join(sorted(kinds))


# -- files --------------------------------------------------------------------


def write_json(path: str | Path, obj) -> None:
    # Serialise first: a value JSON cannot hold leaves the old file untouched.
    write_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    write_bytes(path, buf.getvalue())


def _short(model: str) -> str:
    """A model's name without its folders, for labels."""
    return Path(str(model)).name or str(model)


def plots(entries: list, folder: str | Path) -> list:
    """speedup-vs-quality.png and accepted-lengths.png; [] if matplotlib is missing.

    ``entries``: one dict per model with "model" and "results" (method -> row).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'clp-mlx[bench]')",
              file=sys.stderr)
        return []
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    several = len(entries) > 1

    fig = Figure(figsize=(11, 4.5))
    axes = fig.subplots(1, 2, sharey=True)
    markers = "osD^v<>p*h"
    for j, entry in enumerate(entries):
        for m, r in entry["results"].items():
            label = f"{_short(entry['model'])}: {m}" if several else m
            err = [[r["speedup"] - r["speedup_min"]], [r["speedup_max"] - r["speedup"]]]
            for ax, key in zip(axes, ("repetition", "identical_to_ar")):
                ax.errorbar(r[key], r["speedup"], yerr=err, fmt=markers[j % 10], capsize=3)
                ax.annotate(
                    label,
                    (r[key], r["speedup"]),
                    fontsize=7,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
    axes[0].set_xlabel("repetition ratio (1 - distinct 3-grams / 3-grams)")
    axes[1].set_xlabel("share of outputs identical to ar")
    axes[0].set_ylabel("decode speed-up vs ar (median, min-max)")
    for ax in axes:
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    fig.suptitle("Speed-up against quality")
    _save(fig, folder / PLOTS[0])

    fig = Figure(figsize=(6 * len(entries), 4))
    axes = fig.subplots(1, len(entries), squeeze=False)[0]
    for ax, entry in zip(axes, entries):
        drafting = {m: r["accepted_histogram"] for m, r in entry["results"].items()}
        drafting = {m: h for m, h in drafting.items() if len(h) > 1 and sum(h)}
        width = 0.8 / max(len(drafting), 1)
        for i, (m, h) in enumerate(drafting.items()):
            xs = [n + (i - (len(drafting) - 1) / 2) * width for n in range(len(h))]
            ax.bar(xs, [c / sum(h) for c in h], width=width, label=m)
        if drafting:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no drafting method", ha="center", transform=ax.transAxes)
        ax.set_xlabel("drafts accepted in a pass")
        ax.set_ylabel("share of passes")
        ax.set_xticks(range(max((len(h) for h in drafting.values()), default=1)))
        ax.set_title(_short(entry["model"]))
    _save(fig, folder / PLOTS[1])
    return [folder / name for name in PLOTS]
