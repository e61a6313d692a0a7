"""Hostile command lines (class 3): train, bench, bench_step, distill, generate's and
chat's flags; each must end in one ``error:`` line (argparse: ``usage:``)."""

from __future__ import annotations

from hostile_cases_base import (
    BENCH,
    CHAT,
    DISTILL,
    SERVER,
    STEP,
    TINY_TRAIN,
    TRAIN,
    TRAIN_MTP,
    Inputs,
    gen,
    link,
    put,
    truncate,
)
from hostile_inputs import Batch

# fmt: off
STEP_FLAGS = [  # bench_step
    ("k-0", "-k 0"), ("k-negative", "-k -1"), ("context-0", "--context 0"),
    ("context-negative", "--context -5"), ("repeats-0", "--repeats 0"),
    ("heads-missing", "--heads /nonexistent-hostile"),
]
DISTILL_FLAGS = [
    ("prompts-0", "--prompts 0"), ("prompts-negative", "--prompts -1"),
    ("shard-letters", "--shard a/b"), ("shard-over-zero", "--shard 1/0"),
    ("shard-3-of-2", "--shard 3/2"), ("shard-three-parts", "--shard 0/2/3"),
    ("heldout-2", "--heldout 2"), ("heldout-negative", "--heldout -0.5"),
    ("heldout-nan", "--heldout nan"), ("batch-0", "--batch 0"),
    ("shard-size-0", "--shard-size 0"), ("new-tokens-0", "--new-tokens 0"),
    ("prompt-tokens-0", "--prompt-tokens 0"), ("data-missing", "--data /nonexistent-hostile"),
    ("start-with-wikitext", "--start x"), ("sampled-without-start", "--kind sampled"),
    ("sampled-with-data", "--kind sampled --start x"),
]
TRAIN_MTP_FLAGS = [
    ("soft-2", "--soft 2"), ("soft-nan", "--soft nan"), ("lookup-negative", "--lookup -1"),
    ("lookup-99", "--lookup 99"), ("depths-0", "--depths 0"), ("lr-0", "--lr 0"),
    ("decay-0", "--decay 0"), ("steps-0", "--steps 0"), ("draft-vocab-0", "--draft-vocab 0"),
    ("pointer-negative", "--pointer -1"), ("pointer-lr-alone", "--pointer-lr 1e-3"),
    ("pointer-only-alone", "--pointer 8 --pointer-only"),
]
GENERATE_FLAGS = [  # (name, flags, allowed exit codes)
    ("max-tokens-0", "-m 0", 1), ("max-tokens-negative", "-m -1", 1),
    ("draft-0", "--num-draft-tokens 0", 1), ("draft-99", "--num-draft-tokens 99", 1),
    ("tree-negative", "--tree -1", 1), ("temp-negative", "--temp -1", 1),
    ("temp-nan", "--temp nan", 1), ("temp-inf", "--temp inf", (0, 1)),
    ("top-p-0", "--top-p 0", 1), ("top-p-2", "--top-p 2", 1), ("top-p-nan", "--top-p nan", 1),
    ("top-k-negative", "--top-k -1", 1), ("clp-threshold-2", "--clp-threshold 2", 1),
    ("clp-threshold-nan", "--clp-threshold nan", 1), ("seed-negative", "--seed -1", (0, 1)),
    ("seed-huge", f"--seed {2**70}", (0, 1)),
    ("system-prompt-without-template", "--system-prompt x", 1),
    ("mode-bogus", "--mode bogus", 2), ("dtype-bogus", "--dtype bogus", 2),
    ("max-tokens-letters", "-m abc", 2), ("heads-missing", "--heads /nonexistent-hostile", 1),
    ("draft-len-0", "--draft-len 0", 1), ("kv-bits", "--kv-bits 4", 1),
    ("min-tokens-to-keep-2", "--min-tokens-to-keep 2", 1), ("verbose-bogus", "--verbose maybe", 2),
    ("template-config-list", "--chat-template-config [1]", 1),
    ("extra-eos-bogus", "--extra-eos-token no-such-token", 1),
    ("prefill-step-0", "--prefill-step-size 0", 1), ("max-kv-size-1", "--max-kv-size 1", 1),
]
SERVER_FLAGS = [  # (name, flags, exit code); every good flag set would serve, not exit
    ("port-negative", "--port -1", 1), ("port-70000", "--port 70000", 1),
    ("port-letters", "--port http", 2), ("prompt-cache-negative", "--prompt-cache-size -1", 1),
    ("host-not-here", "--host 203.0.113.7", 1), ("host-unknown", "--host no-such-host.invalid", 1),
    ("max-tokens-0", "-m 0", 1), ("temp-nan", "--temp nan", 1),
    ("heads-missing", "--heads /nonexistent-hostile", 1), ("mode-bogus", "--mode bogus", 2),
]
# fmt: on


def train_cmd(batch: Batch, s: Inputs) -> None:
    def case(name, *argv, expect=(1,), data=None):
        c = batch.new(f"train/{name}", "3")
        d = link(s.text, c.inp / "data.txt") if data is None else data(c)
        out = ["--out", c.inp / "out", "--work-dir", c.inp / "work"]
        c.cli(TRAIN, "--model", s.model, "--data", d, *out, *TINY_TRAIN, *argv, expect=expect)
        c.may_change = ["in/out", "in/work"]
        return c

    case("data-missing", data=lambda c: c.inp / "nothing.txt")
    case("data-is-a-folder", data=lambda c: c.inp)
    case("data-empty", data=lambda c: put(c.inp / "data.txt", ""))
    not_utf8 = bytes(range(128, 256)) * 40
    case("data-not-utf8", data=lambda c: put(c.inp / "data.txt", not_utf8), expect=(0, 1))
    case("draft-vocab-negative", "--draft-vocab", "-1")
    case("lr-nan", "--lr", "nan", expect=(0, 1))
    case("k-zero", "--k", "0")
    case("by-confidence-without-eval", "--by-confidence")
    c = batch.new("train/eval-heads-truncated", "3")
    h = link(s.heads, c.inp / "heads")
    truncate(h / "heads.safetensors", 100)
    data, work = link(s.text, c.inp / "data.txt"), ["--work-dir", c.inp / "work"]
    c.cli(TRAIN, "--eval", "--model", s.model, "--heads", h, "--data", data, *work, *TINY_TRAIN)
    c.may_change = ["in/work"]
    c = batch.new("train/work-dir-is-a-file", "3")
    data, out = link(s.text, c.inp / "data.txt"), ["--out", c.inp / "out"]
    work = ["--work-dir", put(c.inp / "file", "x")]
    c.cli(TRAIN, "--model", s.model, "--data", data, *out, *work, *TINY_TRAIN)


def bench_cmds(batch: Batch, s: Inputs) -> None:
    def case(name, prompts=None, *argv, expect=(1,)):
        c = batch.new(f"bench/{name}", "3")
        src = ["--prompts", put(c.inp / "p.jsonl", prompts)] if prompts is not None else []
        c.cli(BENCH, "--model", s.model, "--heads", "init", "--quick", *src, *argv, expect=expect)
        return c

    case("prompts-not-utf8", b"\xff\xfe hello\n\x80\x81\n", expect=(0, 1))
    case("prompts-json-list", "[1, 2]\n")
    case("prompts-prompt-number", '{"prompt": 5}\n')
    case("prompts-turns-empty", '{"turns": []}\n')
    case("prompts-empty-file", "")
    case("modes-bogus", "hello\n", "--modes", "bogus")
    case("num-prompts-0", "hello\n", "--num-prompts", "0")
    case("json-in-missing-folder", "hello\n", "--json", "/nonexistent-hostile/x.json")
    case("draft-tokens-0", "hello\n", "--draft-tokens", "0")
    case("chat-template-bogus", "hello\n", "--chat-template", "bogus")
    c = case("plots-is-a-file", "hello\n")
    c.spec["argv"] += ["--plots", str(put(c.inp / "plots", "x"))]
    c = case("wikitext-empty")
    c.spec["argv"] += ["--wikitext", str(put(c.inp / "w.raw", ""))]
    for name, flags in STEP_FLAGS:
        c = batch.new(f"bench-step/{name}", "3")
        c.cli(STEP, "--model", s.model, "--repeats", "1", *flags.split())


def distill_cmd(batch: Batch, s: Inputs) -> None:
    for name, flags in DISTILL_FLAGS:
        c = batch.new(f"distill/{name}", "3")
        data = link(s.text, c.inp / "data.txt")
        out = ["--out", c.inp / "out", "--kind", "wikitext", "--data", data]
        small = ["--prompts", "2", "--new-tokens", "2", "--quiet"]
        c.cli(DISTILL, "--model", s.model, *out, *small, *flags.split())
    c = batch.new("distill/code-without-python-files", "3")
    (c.inp / "empty").mkdir()
    out = ["--out", c.inp / "out", "--kind", "code", "--data", c.inp / "empty"]
    c.cli(DISTILL, "--model", s.model, *out, "--prompts", "2", "--quiet")


def train_mtp_cmd(batch: Batch, s: Inputs) -> None:
    """The MTP layer's training and scoring: bad flags on good data, and distilled
    folders that are not there or hold no shard yet."""

    def case(name, *flags, module=TRAIN_MTP, data=None):
        c = batch.new(f"train-mtp/{name}", "3")
        args = [
            "--model",
            s.model,
            "--data",
            *(data(c) if data else [link(s.distilled, c.inp / "d")]),
        ]
        out = ["--heads", s.heads, "--eval"]
        if module == TRAIN_MTP:
            out = ["--out", c.inp / "out", "--steps", "2", "--quiet"]
        c.cli(module, *args, *out, *flags)
        c.may_change = ["in/out"]

    def no_shard(c):
        put(c.inp / "e" / "manifest.json", "{}")  # a distilled folder with no whole shard yet
        return [c.inp / "e"]

    for name, flags in TRAIN_MTP_FLAGS:
        case(name, *flags.split())
    case("data-no-manifest", data=lambda c: [c.inp])
    case("data-no-shards", data=no_shard)
    case("eval-no-held-out-rows", module=TRAIN, data=no_shard)
    text_and_folder = lambda c: [link(s.distilled, c.inp / "d"), link(s.text, c.inp / "t.txt")]
    case("eval-text-and-folder", module=TRAIN, data=text_and_folder)
    text = lambda c: [link(s.text, c.inp / "t.txt")]
    case("eval-by-confidence-on-text", "--by-confidence", module=TRAIN, data=text)


def decode_flags(batch: Batch, s: Inputs) -> None:
    for name, flags, expect in GENERATE_FLAGS:
        c = batch.new(f"flags/{name}", "3")
        gen(c, s.model, *flags.split(), expect=expect if isinstance(expect, tuple) else (expect,))
    c = batch.new("flags/heads-is-a-file", "3")
    gen(c, s.model, "--heads", s.text)
    for name, size in [("max-kv-size-1", "1"), ("max-kv-size-negative", "-3")]:
        c = batch.new(f"chat-flags/{name}", "3")
        c.cli(CHAT, "--model", s.chat_model, "--heads", "init", "--max-kv-size", size, stdin=b"q\n")
    for name, flags, code in SERVER_FLAGS:
        c = batch.new(f"server-flags/{name}", "3")
        c.cli(SERVER, "--model", s.model, "--heads", "init", *flags.split(), expect=(code,))
    c = batch.new("server-flags/model-missing", "3")
    c.cli(SERVER, "--model", c.inp / "no-model", "--port", "0")
    c = batch.new("chat-flags/model-without-template", "3")
    c.cli(CHAT, "--model", s.model, "--heads", "init", stdin=b"q\n")
