"""Package trained heads so that the matching default model finds them.

Example::

    python convert/heads_to_package.py my-heads qwen2.5-coder-0.5b-instruct

Writes ``clp_mlx/shipped/<model name>/``: the weights in float16 (half the
size; they are cast back to the backbone's dtype on load), ``heads.json``
with the backbone fingerprint, and the training report (``training.json``:
command, data, timings, history) and plot. The folder is written under a
temporary name and renamed, so an interrupted run leaves nothing that loads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Let the script run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clp_mlx.cli.args import guarded  # noqa: E402
from clp_mlx.errors import ClpError  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "clp_mlx" / "shipped"


def portable(value):
    """The report with file paths cut to their names: the package names no
    one's folders (``--data /x/y/wiki.train.raw`` -> ``--data wiki.train.raw``)."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str) and "/" in value:
        return " ".join(Path(w).name if "/" in w else w for w in value.split(" "))
    return value


def package_heads(src: Path, name: str, dest_root: Path = SHIPPED) -> Path:
    import mlx.core as mx

    from clp_mlx.model.heads import read_config
    from clp_mlx.paths import atomic_folder
    from clp_mlx.sources.resolve import NAMED_MODELS

    if name not in NAMED_MODELS:
        raise ClpError(f"{name!r} is not a named default model ({', '.join(NAMED_MODELS)})")
    config = read_config(src)  # checks that src holds heads
    if not (src / "training.json").is_file():
        raise ClpError(f"{src} has no training.json: only trained heads with a report ship")
    weights = mx.load(str(src / "heads.safetensors"))
    half = {
        k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    dest = dest_root / name
    with atomic_folder(dest) as tmp:
        mx.save_safetensors(str(tmp / "heads.safetensors"), half)
        meta = json.loads((src / "heads.json").read_text())
        meta["backbone"] = name
        (tmp / "heads.json").write_text(json.dumps(portable(meta), indent=1) + "\n")
        report = json.loads((src / "training.json").read_text())
        (tmp / "training.json").write_text(json.dumps(portable(report), indent=1) + "\n")
        if (src / "training.png").is_file():
            shutil.copy(src / "training.png", tmp / "training.png")
    print(
        json.dumps(
            {
                "shipped": str(dest),
                "k": config.k,
                "design": config.design,
                "fingerprint": config.fingerprint,
            }
        )
    )
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("heads", help="a trained heads folder (python -m clp_mlx.train --out ...)")
    p.add_argument("model", help="the named default model these heads belong to")
    args = p.parse_args(argv)

    def ship() -> None:
        package_heads(Path(args.heads), args.model)

    return guarded(ship)


if __name__ == "__main__":
    sys.exit(main())
