"""Prompts cut from text for self-distillation: WikiText paragraphs, code blocks.

A prompt is ``length`` tokens cut from one paragraph (a WikiText line that is
not a heading) or one code block (the text between blank lines of a ``.py``
file). Paragraphs are visited in a seeded order, so prompts come from the
whole corpus rather than its first articles; every paragraph gives its
opening first, and only when the openings run out do the next windows
(tokens ``length`` to ``2 * length``, and so on) come in. A prompt equal to
an earlier one is skipped: every prompt of a run is distinct.

Only the paragraphs a run needs are tokenized (a few thousand for the planned
data), so a restart rebuilds the same list in seconds.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from ..errors import ClpError

# Folders of installed packages: the standard library's folder holds
# site-packages, whose contents change with every pip install; a corpus that
# changed would make a resumed run refuse its own folder.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def source_files(kind: str, paths: list[str]) -> list[Path]:
    """The files ``paths`` name: files as given; folders (code only) walked
    for ``*.py`` in path order, skipping installed packages and hidden folders."""
    if not paths:
        raise ClpError(f"--kind {kind} needs --data: the text files to cut prompts from")
    files: list[Path] = []
    for given in paths:
        p = Path(given)
        if p.is_file():
            files.append(p)
        elif p.is_dir() and kind == "code":
            files.extend(sorted(_python_files(p), key=lambda f: f.relative_to(p).as_posix()))
        elif p.is_dir():
            raise ClpError(f"{given} is a folder; --kind {kind} takes text files")
        else:
            raise ClpError(f"input {given} does not exist")
    return files


def _python_files(folder: Path):
    for f in folder.rglob("*.py"):
        parts = f.relative_to(folder).parts[:-1]
        if f.is_file() and not any(d in SKIP_DIRS or d.startswith(".") for d in parts):
            yield f


def paragraphs(kind: str, text: str) -> list[str]:
    """WikiText: each non-empty line but ' = Heading = ' lines. Code: blocks
    between blank lines, indentation kept (a block is often a def or a class)."""
    if kind == "wikitext":
        lines = (line.strip() for line in text.splitlines())
        return [s for s in lines if s and not (s.startswith("=") and s.endswith("="))]
    blocks = (b.strip("\n").rstrip() for b in _BLANK_LINE.split(text))
    return [b for b in blocks if b.strip()]


def text_prompts(
    tokenizer, kind: str, paths: list[str], *, count: int, length: int, seed: int
) -> tuple[np.ndarray, str]:
    """``count`` distinct prompts of ``length`` tokens, (count, length) int32,
    and a sha256 of the inputs' content: every file's bytes, then the prompts."""
    digest = hashlib.sha256()
    paras: list[str] = []
    for f in source_files(kind, paths):
        data = f.read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
        paras.extend(paragraphs(kind, data.decode("utf-8", errors="replace")))
    prompts = cut_prompts(tokenizer, paras, count=count, length=length, seed=seed)
    digest.update(prompts.tobytes())
    return prompts, digest.hexdigest()


def cut_prompts(tokenizer, paras: list[str], *, count: int, length: int, seed: int) -> np.ndarray:
    """Windows of ``length`` tokens: openings first, then deeper windows (see above)."""
    order = [int(i) for i in np.random.default_rng([seed, 11]).permutation(len(paras))]
    encoded: dict[int, np.ndarray] = {}
    seen: set[bytes] = set()
    out: list[np.ndarray] = []
    depth = 0
    while order and len(out) < count:
        deeper = []  # paragraphs with a window at this depth: candidates for the next
        for i in order:
            if i not in encoded:
                ids = tokenizer.encode(paras[i], add_special_tokens=False)
                encoded[i] = np.asarray(ids, dtype=np.int32)
            window = encoded[i][depth * length : (depth + 1) * length]
            if window.size < length:
                del encoded[i]  # never long enough again: free it
                continue
            deeper.append(i)
            if window.tobytes() not in seen:
                seen.add(window.tobytes())
                out.append(window)
                if len(out) == count:
                    break
        order, depth = deeper, depth + 1
    if len(out) < count:
        raise ClpError(
            f"the data gives {len(out)} distinct prompts of {length} tokens, fewer than "
            f"--prompts {count}; give more text or lower --prompts or --prompt-tokens"
        )
    return np.stack(out)
