"""What runs leave (classes 2, 4, 5): converters never destroy the source or a foreign
folder, a killed run's leftovers are cleared by the next, nothing is silently accepted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
from hostile_cases_base import (
    CHAT,
    CONVERT,
    DISTILL,
    TINY_TRAIN,
    TRAIN,
    Inputs,
    edit_json,
    gen,
    hf_folder_case,
    link,
    put,
)
from hostile_inputs import Batch, Case, dead_pid

# -- class 2: converters never destroy the source or a foreign folder ------------------------


def converters_keep_data(batch: Batch, s: Inputs) -> None:
    def new(name: str, src: Path, at: str) -> tuple[Case, Path]:  # src linked at `at`
        c = batch.new(f"keep/{name}", "2")
        return c, link(src, c.root / at)

    def foreign(c: Case) -> Path:
        put(c.inp / "foreign" / "notes.txt", "mine, not a model\n")
        put(c.inp / "foreign" / "sub" / "data.bin", bytes(range(256)))
        return c.inp / "foreign"

    for kind, src, rest in [
        ("gguf", s.gguf, ["--no-progress"]),
        ("heads-from-torch", s.torch_heads, ["--model", s.model]),
    ]:
        c, f = new(f"{kind}-out-dot", src, f"cwd/{src.name}")
        c.cli(CONVERT, kind, f.name, *rest, "-o", ".", "--force")
        c, f = new(f"{kind}-out-source-folder", src, f"in/src/{src.name}")
        c.cli(CONVERT, kind, f, *rest, "-o", f.parent, "--force")
        c, f = new(f"{kind}-out-foreign-folder", src, f"in/{src.name}")
        c.cli(CONVERT, kind, f, *rest, "-o", foreign(c), "--force")
    c, _ = new("hf-out-dot-holding-source", s.hf, "cwd/src")
    c.cli(CONVERT, "hf", "src", "-o", ".", "--force")
    c = batch.new("keep/hf-out-dot-is-source", "2")
    for f in s.hf.iterdir():
        link(f, c.cwd / f.name)
    c.cli(CONVERT, "hf", ".", "-o", ".", "--force")
    c, f = new("hf-out-parent-of-source", s.hf, "in/parent/src")
    c.cli(CONVERT, "hf", f, "-o", f.parent, "--force")
    c, f = new("hf-out-foreign-folder", s.hf, "in/src")
    c.cli(CONVERT, "hf", f, "-o", foreign(c), "--force")
    c, _ = new("train-out-dot-holding-data", s.text, "cwd/data.txt")
    c.cli(TRAIN, "--model", s.model, "--data", "data.txt", "--out", ".", "--force", *TINY_TRAIN)
    c, f = new("train-out-foreign-folder", s.text, "in/data.txt")
    out = ["--out", foreign(c), "--force", "--work-dir", c.inp / "work"]
    c.cli(TRAIN, "--model", s.model, "--data", f, *out, *TINY_TRAIN, may_change=["in/work"])
    c, f = new("distill-out-foreign-folder", s.text, "in/data.txt")
    out = ["--out", foreign(c), "--kind", "wikitext", "--data", f]
    small = ["--prompts", "2", "--prompt-tokens", "8", "--new-tokens", "2", "--quiet"]
    c.cli(DISTILL, "--model", s.model, *out, *small, expect=(0, 1, 3), may_add=["in/foreign"])


# -- class 4: what a killed run left is cleared by the next ------------------------------------


def _gone(*paths):
    def check(case: Case, result: dict):
        left = [str(p.relative_to(case.root)) for p in paths if p.exists() or p.is_symlink()]
        return f"stale leftovers not removed: {', '.join(left)}" if left else None

    return check


def _stale(folder: Path) -> Path:
    put(folder / "junk.bin", b"half written")
    return folder


def leftovers(batch: Batch, s: Inputs) -> None:
    from clp_mlx.sources.model_cache import fingerprint

    def swept(c: Case, *stale: Path, also=()) -> dict:  # the run must remove `stale`
        rel = [str(p.relative_to(c.root)) for p in stale]
        return {"expect": (0,), "check": _gone(*stale), "may_change": [*also, *rel]}

    def convert_gguf(c: Case, **kw) -> Case:
        g = link(s.gguf, c.inp / "x.gguf")
        return c.cli(CONVERT, "gguf", g, "-o", c.inp / "out", "--no-progress", **kw)

    dead = dead_pid()
    c = batch.new("stale/convert-output-partial-and-old", "4")
    stale = [_stale(c.inp / f".out.partial-{dead}"), _stale(c.inp / f".out.old-{dead}")]
    convert_gguf(c, **swept(c, *stale, also=["in/out"]))
    c = batch.new("stale/live-process-partial-kept", "4")
    live = _stale(c.inp / f".out.partial-{os.getpid()}")  # pytest's own: alive, maybe writing

    def kept(case, result):
        return None if (live / "junk.bin").exists() else "removed a live process's partial"

    convert_gguf(c, expect=(0,), may_change=["in/out"], check=kept)
    c = batch.new("stale/heads-output-partial", "4")
    pt = link(s.torch_heads, c.inp / "x.pt")
    stale = _stale(c.inp / f".heads.partial-{dead}")
    out = ["--model", s.model, "-o", c.inp / "heads"]
    c.cli(CONVERT, "heads-from-torch", pt, *out, **swept(c, stale, also=["in/heads"]))
    c = batch.new("stale/cache-model-partial", "4")
    g = link(s.gguf, c.inp / "x.gguf")
    name = f"x-{fingerprint([g])}-float32"
    gen(c, g, **swept(c, _stale(c.home / "models" / f".{name}.partial-{dead}")))
    c = batch.new("stale/cache-file-partial", "4")
    kw = swept(c, put(c.home / f".pass_costs.json.partial-{dead}", "{"))
    gone = kw.pop("check")

    def written_and_swept(case, result):
        if not (case.home / "pass_costs.json").is_file():
            return "the run wrote no pass_costs.json: not the next run of that writer (test setup)"
        return gone(case, result)

    gen(c, s.model, "--verify-feed", "cost", check=written_and_swept, **kw)
    c.spec["argv"][c.spec["argv"].index("-m") + 1] = "12"


# -- class 5: what must not be accepted silently (and what must be accepted) -------------------


def silent(batch: Batch, s: Inputs) -> None:
    def short_context(c: Case) -> Path:  # the model, able to read 16 positions
        m = link(s.model, c.inp / "model")
        edit_json(m / "config.json", max_position_embeddings=16)
        return m

    c = batch.new("silent/prompt-longer-than-context", "5")
    gen(c, short_context(c))
    c.spec["argv"][c.spec["argv"].index("hello")] = "hello world, " * 4
    c = batch.new("silent/api-prompt-longer-than-context", "5")
    runs = [{"prompt": list(range(40)), "options": {"mode": "ar"}}]
    c.api(str(short_context(c)), "init", runs=runs, want="clp")
    for via in (CONVERT,):  # (an MLX folder's loader reads no index: nothing to escape through)
        for where in ("relative", "absolute"):

            def outside(c, src, where=where):
                moved = c.inp / "outside" / "model.safetensors"
                moved.parent.mkdir()
                os.rename(src / "model.safetensors", moved)
                shard = "../outside/model.safetensors" if where == "relative" else str(moved)
                index = {"weight_map": {n: shard for n in mx.load(str(moved))}}
                put(src / "model.safetensors.index.json", json.dumps(index))

            name = f"silent/hf-index-{where}-outside-{via.split('.')[-1]}"
            hf_folder_case(batch, s, name, outside, "5", via)
    for name, model, heads, want in [
        ("load-path-object", {"path": str(s.model)}, "init", "ok"),
        ("load-heads-path-object", str(s.model), {"path": str(s.heads)}, "ok"),
        ("load-empty-model-name", "", "init", "clp"),
        ("load-blank-model-name", "  ", "init", "clp"),
        ("load-empty-heads-name", str(s.model), "", "clp"),
    ]:
        c = batch.new(f"silent/{name}", "5")
        c.api(model, heads, runs=[{"prompt": "hi", "options": {"max_tokens": 2}}], want=want)
    for name, flags in [
        ("model-empty", ["--model", ""]),
        ("heads-empty", ["--heads", ""]),
        ("draft-tokens-with-ar", ["--num-draft-tokens", "2", "--mode", "ar"]),
    ]:
        c = batch.new(f"silent/{name}", "5")
        gen(c, s.model, *flags)
    c = batch.new("silent/chat-draft-tokens-with-ar", "5")
    ar = ["--num-draft-tokens", "2", "--mode", "ar"]
    c.cli(CHAT, "--model", s.chat_model, "--heads", "init", *ar, stdin=b"q\n")
