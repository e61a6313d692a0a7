"""How self-distilled data lies on disk, and how a restart knows what is whole.

``DIR/manifest.json`` names what the data is of; shard ``j`` (prompt indices
``j * S`` to ``(j + 1) * S``) is up to two folders of ``.npy`` files,
``shard-j`` (training rows) and ``heldout-j`` (held-out rows, when it has
any), and a sidecar ``shard-j.json`` with each folder's sha256. Folders are
written to hidden temporary siblings and renamed whole; the sidecar is
written last. So after a SIGKILL at any moment a shard is either whole with a
sidecar that verifies, or is made again: its folders, sidecar and temporary
leftovers are removed first. ``.npy`` files rather than ``.npz``: a zip
records the time it was written, so a remade shard would differ in bytes.

One process owns a shard at a time: it holds a lock on the shard's byte of
``DIR/.locks`` while it checks or makes it (released by the kernel when the
process dies), so a second copy of the command started by mistake, or with
another ``--shard`` split, skips that shard instead of deleting its work.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..errors import ClpError
from ..paths import atomic_folder, write_text
from ..sources.converting import read_json

MANIFEST = "manifest.json"
LOCKS = ".locks"
TRAIN, HELD = "shard", "heldout"
PAD = -1  # token id of the positions after a row's end (rows of a shard differ in length)


def read_object(path: Path, what: str) -> dict:
    """``path``'s JSON object; a ClpError naming it when it is not one."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise ClpError(f"{path} is not a {what}: remove the folder, or make it again")
    return value


def read_manifest(out: Path) -> dict:
    return read_object(out / MANIFEST, "self-distilled data manifest")


def sidecar_folders(side: Path) -> dict:
    """The folders a shard's sidecar names: name -> {rows, positions, sha256}."""
    folders = read_object(side, "shard sidecar").get("folders")
    counts = ("rows", "positions")
    if not isinstance(folders, dict) or not all(
        isinstance(i, dict) and all(isinstance(i.get(c), int) for c in counts)
        for i in folders.values()
    ):
        raise ClpError(f"{side} is not a shard sidecar: remove the folder, or make it again")
    return folders


def folder_name(prefix: str, j: int) -> str:
    return f"{prefix}-{j:06d}"


def sidecar(out: Path, j: int) -> Path:
    return out / f"{folder_name(TRAIN, j)}.json"


def folder_sha256(folder: Path) -> str:
    """sha256 over the folder's file names and contents, in name order."""
    total = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        total.update(f"{f.name}\0{h.hexdigest()}\n".encode())
    return total.hexdigest()


def check_manifest(out: Path, manifest: dict, compared: tuple[str, ...]) -> None:
    """Refuse a folder made from other inputs or arguments; start a new one."""
    path = out / MANIFEST
    if path.is_file():
        differ = _differences(read_manifest(out), manifest, compared)
        if differ:
            raise ClpError(
                f"{out} holds data made with other {'; '.join(differ)}; resume with the "
                "same arguments and inputs, or write to a new --out"
            )
        return
    if out.exists() and not out.is_dir():
        raise ClpError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(not p.name.startswith(".") for p in out.iterdir()):
        raise ClpError(f"--out {out} is not empty and holds no {MANIFEST}; use a new folder")
    write_text(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _differences(old: dict, new: dict, compared: tuple[str, ...]) -> list[str]:
    """What differs, for people: "new_tokens (96 there, 64 here)", "inputs"."""
    differ = []
    for key in compared:
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differ += [
                f"{k} ({a.get(k)} there, {b.get(k)} here)"
                for k in sorted(a.keys() | b.keys())
                if a.get(k) != b.get(k)
            ]
        elif a != b:
            differ.append("input content (files or prompts)" if key == "inputs" else key)
    return differ


@contextmanager
def owning(out: Path, j: int) -> Iterator[bool]:
    """True while this process holds shard ``j``; False if another one does."""
    with open(out / LOCKS, "ab") as fh:
        try:
            fcntl.lockf(fh, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, j)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.lockf(fh, fcntl.LOCK_UN, 1, j)


def is_complete(out: Path, j: int) -> bool:
    """The shard's sidecar is there and every folder it names matches its sha256."""
    try:
        folders = sidecar_folders(sidecar(out, j))
        return all(
            (out / name).is_dir() and folder_sha256(out / name) == info["sha256"]
            for name, info in folders.items()
        )
    except (ClpError, OSError, KeyError, TypeError):
        return False


def clear_leftovers(out: Path, j: int) -> None:
    """Remove the temporary files and folders a killed run left of shard ``j``."""
    for prefix in (TRAIN, HELD):
        name = folder_name(prefix, j)
        for p in [*out.glob(f".{name}.partial-*"), *out.glob(f".{name}.json.partial-*")]:
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def clear(out: Path, j: int) -> None:
    """Remove all a run left of shard ``j``: sidecar (first), folders, temporaries."""
    sidecar(out, j).unlink(missing_ok=True)
    for prefix in (TRAIN, HELD):
        shutil.rmtree(out / folder_name(prefix, j), ignore_errors=True)
    clear_leftovers(out, j)


def pack(rows: list, kind: str, side_layers=()) -> dict[str, np.ndarray]:
    """Rows (index, prompt_len, tokens, hidden[, side]) as arrays, right-padded
    to the longest; with ``side_layers``, the earlier layers' states as
    ``side`` (rows, length, layers, hidden) and the layers' numbers."""
    length = max(len(r.tokens) for r in rows)
    tokens = np.full((len(rows), length), PAD, dtype=np.int32)
    hidden = np.zeros((len(rows), length, rows[0].hidden.shape[-1]), dtype=np.float16)
    extra = {}
    if side_layers:
        side = np.zeros((len(rows), length, *rows[0].side.shape[1:]), dtype=np.float16)
        for n, r in enumerate(rows):
            side[n, : len(r.tokens)] = r.side
        extra = {"side": side, "side_layers": np.asarray(side_layers, dtype=np.int32)}
    for n, r in enumerate(rows):
        tokens[n, : len(r.tokens)] = r.tokens
        hidden[n, : len(r.tokens)] = r.hidden
    return {
        **extra,
        "tokens": tokens,
        "hidden": hidden,
        "prompt_len": np.asarray([r.prompt_len for r in rows], dtype=np.int32),
        "row_len": np.asarray([len(r.tokens) for r in rows], dtype=np.int32),
        "index": np.asarray([r.index for r in rows], dtype=np.int64),
        "kind": np.asarray([kind] * len(rows), dtype="<U8"),
    }


def write_shard(out: Path, j: int, parts: dict[str, list], kind: str, side_layers=()) -> dict:
    """Write shard ``j``'s folders (``parts``: prefix -> rows), then its sidecar."""
    folders = {}
    for prefix, rows in parts.items():
        if not rows:
            continue
        name = folder_name(prefix, j)
        with atomic_folder(out / name) as tmp:
            for key, array in pack(rows, kind, side_layers).items():
                np.save(tmp / f"{key}.npy", array)
        positions = sum(len(r.tokens) for r in rows)
        folders[name] = {
            "rows": len(rows),
            "positions": positions,
            "sha256": folder_sha256(out / name),
        }
    info = {"shard": j, "folders": folders}
    write_text(sidecar(out, j), json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def shard_folders(out: Path, heldout: bool = False) -> list[Path]:
    """The training (or held-out) folders of the shards with a sidecar, in order."""
    prefix = HELD if heldout else TRAIN
    found = []
    for side in sorted(out.glob(f"{TRAIN}-*.json")):
        names = sidecar_folders(side)
        found += [out / n for n in names if n.startswith(prefix + "-")]
    return found


# A shard's arrays: their dimensions and kinds of number (the rest, e.g. "kind", unchecked).
ARRAYS = {"tokens": (2, "iu"), "hidden": (3, "f"), "prompt_len": (1, "iu"), "row_len": (1, "iu"),
          "index": (1, "iu")}  # fmt: skip


def load_shard(folder: Path) -> dict[str, np.ndarray]:
    """A shard folder's arrays, memory-mapped (hidden states are most of the
    bytes); a ClpError when one is missing, unreadable or of the wrong shape."""
    try:
        arrays = {f.stem: np.load(f, mmap_mode="r") for f in sorted(folder.glob("*.npy"))}
    except (OSError, ValueError, EOFError) as e:
        raise ClpError(f"{folder}: a shard file cannot be read ({str(e)[:120]})") from None
    for key, (dims, kinds) in ARRAYS.items():
        a = arrays.get(key)
        if a is None or a.ndim != dims or a.dtype.kind not in kinds:
            raise ClpError(f"{folder}: not a whole shard ({key}.npy missing or malformed)")
    rows = arrays["tokens"].shape[0]
    if arrays["hidden"].shape[:2] != arrays["tokens"].shape or any(
        arrays[k].shape[0] != rows for k in ("prompt_len", "row_len", "index")
    ):
        raise ClpError(f"{folder}: not a whole shard (its arrays disagree on rows or length)")
    side, layers = arrays.get("side"), arrays.get("side_layers")
    if (side is None) != (layers is None) or side is not None and (
        side.ndim != 4 or side.shape[:2] != arrays["tokens"].shape
        or side.shape[2:] != (layers.size, arrays["hidden"].shape[2])
    ):  # fmt: skip
        raise ClpError(f"{folder}: not a whole shard (side.npy and side_layers.npy disagree)")
    return arrays


def totals(out: Path) -> dict:
    """Rows and positions of the shards with a sidecar, and distinct training prompts."""
    count = {"shards": 0, TRAIN: 0, HELD: 0, "positions": 0}
    for side in sorted(out.glob(f"{TRAIN}-*.json")):
        count["shards"] += 1
        for name, info in sidecar_folders(side).items():
            count[name.split("-")[0]] += info["rows"]
            count["positions"] += info["positions"]
    prompts = set()
    for folder in shard_folders(out):
        arrays = load_shard(folder)
        for row, n in zip(arrays["tokens"], arrays["prompt_len"]):
            prompts.add(row[:n].tobytes())
    return {**count, "distinct": len(prompts)}


def describe(out: Path) -> dict:
    """A data folder for a training report: its kind, source names, settings
    and totals (no paths: the report names no one's folders)."""
    manifest = read_manifest(out)
    sources = manifest.get("sources") if isinstance(manifest.get("sources"), dict) else {}
    about = {
        "folder": out.name,
        "model": Path(sources["model"]).name if sources.get("model") else None,
        "data": [Path(d).name for d in sources.get("data") or []],
        "settings": manifest.get("settings"),
    }
    count = totals(out)
    return {**about, "shards": count["shards"], "training_rows": count[TRAIN],
            "held_out_rows": count[HELD], "positions": count["positions"],
            "distinct_training_prompts": count["distinct"]}  # fmt: skip

