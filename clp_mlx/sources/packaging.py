"""Trained heads packaged so that the matching named default model finds them.

:func:`package_heads` writes ``clp_mlx/shipped/<model name>/``: the weights
in float16 (half the size; they are cast back to the backbone's dtype on
load), ``heads.json`` with the backbone fingerprint, and the training report
(``training.json``: command, data, timings, history) and plot. The folder is
written under a temporary name and renamed, so an interrupted run leaves
nothing that loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

from ..errors import ClpError
from ..model.heads_files import read_config
from ..paths import atomic_folder
from ..model.heads_files import SHIPPED, holds_only_heads
from .converting import read_json, writing
from .resolve import NAMED_MODELS



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


def package_heads(src: str | Path, name: str, dest_root: str | Path | None = None) -> Path:
    """Copy the trained heads in ``src`` into ``dest_root/name`` (default root:
    :data:`SHIPPED`) for the named default model ``name``; return that folder."""
    src = Path(src)
    if name not in NAMED_MODELS:
        raise ClpError(f"{name!r} is not a named default model ({', '.join(NAMED_MODELS)})")
    read_config(src)  # checks that src holds heads
    if not (src / "training.json").is_file():
        raise ClpError(f"{src} has no training.json: only trained heads with a report ship")
    meta, report = read_json(src / "heads.json", "heads file"), read_json(src / "training.json", "report")
    if not isinstance(meta, dict) or not isinstance(report, dict):
        raise ClpError(f"{src}: heads.json and training.json must each hold a JSON object")
    try:
        weights = mx.load(str(src / "heads.safetensors"))
    except (RuntimeError, ValueError, OSError) as e:
        raise ClpError(f"{src}/heads.safetensors cannot be read ({e})") from None
    half = {
        k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    dest = Path(SHIPPED if dest_root is None else dest_root) / name
    with writing(dest), atomic_folder(dest, ours=holds_only_heads) as tmp:
        mx.save_safetensors(str(tmp / "heads.safetensors"), half)
        meta["backbone"] = name
        (tmp / "heads.json").write_text(json.dumps(portable(meta), indent=1) + "\n")
        (tmp / "training.json").write_text(json.dumps(portable(report), indent=1) + "\n")
        if (src / "training.png").is_file():
            shutil.copy(src / "training.png", tmp / "training.png")
    return dest
