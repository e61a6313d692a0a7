"""Self-distilled data (clp_mlx.cli.distill) on a tiny model: shards, resume
after SIGKILL, checksums, refusal of changed inputs, split runs, held-out
prompts and Magpie prompts."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model, write_model_folder
from mlx_lm.models.cache import make_prompt_cache

from clp_mlx.cli.args import guarded
from clp_mlx.cli.distill import main
from clp_mlx.errors import ClpError
from clp_mlx.model.backbone import load_backbone, project
from clp_mlx.train import selfdistill_magpie as magpie
from clp_mlx.train import selfdistill_store as store
from clp_mlx.train.mtp_data import Rows
from clp_mlx.train.selfdistill import continue_batch, is_heldout
from clp_mlx.train.selfdistill_prompts import cut_prompts, source_files

REPO = Path(__file__).resolve().parents[1]
WORDS = "the of and a to in is was for on as with by he at from his an were are which".split()
# Kills the command at the n-th call of one of its functions (deterministic
# points a SIGKILL can fall on), then runs it as `python -m clp_mlx.cli.distill`.
KILLER = """
import os, signal, sys
import numpy
from clp_mlx.train import selfdistill_store as store
target, name, n = {target}, {name!r}, {n}
real, calls = getattr(target, name), []
def dying(*a, **k):
    calls.append(1)
    if len(calls) == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
setattr(target, name, dying)
from clp_mlx.cli.distill import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    write_model_folder(root / "tiny", tiny_model(0))
    rng = np.random.default_rng(0)
    lines = []
    for a in range(40):
        lines.append(f" = Article {a} = ")
        for _ in range(3):
            lines.append(" " + " ".join(rng.choice(WORDS, rng.integers(4, 40))) + " .")
    (root / "wiki.txt").write_text("\n".join(lines) + "\n")
    return root


def argv(root, out, *extra, prompts=40, new=24):
    return [
        "--model", str(root / "tiny"), "--out", str(root / out), "--kind", "wikitext",
        "--data", str(root / "wiki.txt"), "--prompts", str(prompts), "--prompt-tokens", "8",
        "--new-tokens", str(new), "--batch", "3", "--shard-size", "5", "--heldout", "0.2",
        "--quiet", *extra,
    ]  # fmt: skip


def command(*args) -> list[str]:
    return [sys.executable, "-m", "clp_mlx.cli.distill", *args]


def files(folder: Path) -> dict[str, bytes]:
    """The shards' bytes: folders and sidecars, not the manifest (it records paths)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (store.MANIFEST, store.LOCKS)
    }


@pytest.fixture(scope="module")
def reference(root):
    assert main(argv(root, "ref")) == 0
    return root / "ref"


def test_shards_are_whole_checksummed_greedy_rows(root, reference):
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["settings"]["new_tokens"] == 24 and manifest["shards"] == 8
    assert len(manifest["inputs"]) == 64 and len(manifest["backbone"]) == 16
    model, _ = load_backbone(root / "tiny")
    rows = 0
    for j in range(8):
        info = json.loads(store.sidecar(reference, j).read_text())
        for name, entry in info["folders"].items():
            assert store.folder_sha256(reference / name) == entry["sha256"]
            a = store.load_shard(reference / name)
            n = entry["rows"]
            rows += n
            assert a["tokens"].shape == (n, 32) and a["tokens"].dtype == np.int32
            assert a["hidden"].shape == (n, 32, 64) and a["hidden"].dtype == np.float16
            assert (a["prompt_len"] == 8).all() and (a["row_len"] == 32).all()
            assert set(a["kind"]) == {"wikitext"} and set(a["index"]) <= set(range(5 * j, 5 * j + 5))
    assert rows == 40
    # A row is the backbone's own greedy text, and its hidden states are the
    # final-norm states of a teacher-forced pass over it, up to fp16.
    a = store.load_shard(reference / "shard-000003")
    for tokens, hidden in zip(a["tokens"][:2], a["hidden"][:2]):
        h = model.model(mx.array(tokens)[None])[0]
        greedy = mx.argmax(project(model, h), axis=-1)
        assert greedy[7:-1].tolist() == tokens[8:].tolist()
        assert np.abs(np.array(h) - hidden.astype(np.float32)).max() < 2e-2


def test_left_padded_batches_continue_each_prompt_as_alone():
    model = tiny_model(1)
    prompts = [np.array(p, np.int32) for p in ([5, 9, 2], [7, 1, 4, 8, 3, 6], [11])]
    tokens, hidden, _ = continue_batch(model, prompts, 6)
    for p, t, h in zip(prompts, tokens, hidden):
        cache = make_prompt_cache(model)
        x, want = mx.array(p)[None], []
        for _ in range(6):
            x = mx.argmax(project(model, model.model(x, cache=cache)[:, -1:]), axis=-1)
            want.append(x.item())
        assert t.tolist() == p.tolist() + want and h.shape == (len(p) + 6, 64)
        full = model.model(mx.array(t)[None])[0]
        assert np.abs(np.array(full) - h.astype(np.float32)).max() < 2e-2


def test_a_killed_run_resumes_to_the_same_bytes(root, reference):
    """The command killed with SIGKILL once its first shard exists, then run again."""
    out = root / "killed"
    proc = subprocess.Popen(command(*argv(root, "killed", new=64)), cwd=REPO)
    # A longer run (new tokens 64) so the kill falls mid-way; where it falls
    # does not matter to what is checked.
    while not store.sidecar(out, 0).exists() and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert main(argv(root, "killed", new=64)) == 0
    again = root / "uninterrupted"
    assert main(argv(root, "uninterrupted", new=64)) == 0
    assert files(out) == files(again)
    assert not [p for p in out.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize(
    "target, name, calls",
    [("store", "folder_sha256", 1), ("numpy", "save", 6)],
    ids=["between-folder-and-sidecar", "mid-folder"],
)
def test_a_kill_at_any_point_loses_only_that_shard(root, reference, target, name, calls):
    """Killed in shard 1: after its training folder is renamed into place but
    before its sidecar, or half-way through writing that folder."""
    out = root / f"killed-{name}"
    first = len(json.loads(store.sidecar(reference, 0).read_text())["folders"])
    n = calls * first + calls // 2 + 1  # a call of shard 1's first folder
    code = KILLER.format(target=target, name=name, n=n)
    done = subprocess.run([sys.executable, "-c", code, *argv(root, out.name)], cwd=REPO)
    assert done.returncode == -signal.SIGKILL
    left = sorted(p.name for p in out.iterdir())
    assert "shard-000001.json" not in left and "shard-000000.json" in left
    assert any(".partial-" in p for p in left) == (name == "save")
    assert main(argv(root, out.name)) == 0
    assert files(out) == files(reference)
    assert not [p for p in out.iterdir() if ".partial-" in p.name]


def test_a_corrupt_or_unrecorded_shard_is_made_again(root, reference, capsys):
    out = root / "damaged"
    shutil.copytree(reference, out)
    hidden = out / "shard-000001" / "hidden.npy"
    data = bytearray(hidden.read_bytes())
    data[-3] ^= 0xFF
    hidden.write_bytes(bytes(data))
    store.sidecar(out, 4).unlink()  # killed between its folders and its sidecar
    (out / ".shard-000006.partial-x1y2").mkdir()  # killed while writing
    (out / ".shard-000006.partial-x1y2" / "tokens.npy").write_bytes(b"half")
    (out / ".shard-000002.json.partial-123").write_text("{")
    assert main(argv(root, "damaged")) == 0
    assert "8 of 8 whole (2 made now" in capsys.readouterr().out
    assert files(out) == files(reference)
    assert not [p for p in out.iterdir() if ".partial-" in p.name]


def test_other_inputs_or_arguments_are_refused(root, reference, capsys):
    out = root / "changed"
    shutil.copytree(reference, out)
    text = root / "wiki.txt"
    changed = root / "changed.txt"
    changed.write_text(text.read_text().replace(" the ", " a ", 1))
    args = argv(root, "changed")
    args[args.index(str(text))] = str(changed)
    assert guarded(lambda: main(args)) == 1
    assert guarded(lambda: main(argv(root, "changed", new=25))) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "input content" in err[0] and "new_tokens (24 there, 25 here)" in err[1]
    assert files(out) == files(reference)
    # the same text under another path is the same input
    moved = root / "moved.txt"
    shutil.copy(text, moved)
    args[args.index(str(changed))] = str(moved)
    assert main(args) == 0


def test_two_processes_split_the_shards(root, reference):
    out = root / "split"
    procs = [subprocess.Popen(command(*argv(root, "split", "--shard", f"{i}/2")), cwd=REPO) for i in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    assert files(out) == files(reference)


@pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch is not installed")
def test_mlx_launch_ranks_split_the_shards(root, reference):
    launch = [shutil.which("mlx.launch"), "-n", "2", "--backend", "ring", sys.executable]
    done = subprocess.run(
        [*launch, "-m", "clp_mlx.cli.distill", *argv(root, "launched")], cwd=REPO, timeout=120,
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "shards 0/2" in done.stdout and "shards 1/2" in done.stdout
    assert files(root / "launched") == files(reference)


def test_heldout_prompts_never_reach_training_shards(reference):
    def prompts(heldout):
        found = []
        for folder in store.shard_folders(reference, heldout):
            a = store.load_shard(folder)
            found += [t[:n].tobytes() for t, n in zip(a["tokens"], a["prompt_len"])]
        return found

    train, held = prompts(False), prompts(True)
    assert held and len(set(train)) == len(train) and len(train) + len(held) == 40
    assert not set(train) & set(held)
    assert all(is_heldout(np.frombuffer(p, np.int32), 0.2) for p in held)
    assert store.totals(reference)["distinct"] == len(train)


def test_heldout_1_makes_an_evaluation_only_folder(root):
    """WikiText-2 valid, say: every prompt held out, none to train on."""
    assert main(argv(root, "all-held", "--heldout", "1", prompts=10, new=6)) == 0
    out = root / "all-held"
    assert not store.shard_folders(out) and not list(out.glob("shard-*[0-9]"))
    width = store.load_shard(store.shard_folders(out, True)[0])["hidden"].shape[2]
    shape = SimpleNamespace(hidden_size=width, vocab_size=1 << 17)
    held = Rows.for_model([out], shape, heldout=True)
    assert len(held) == 10 and held.positions() == 10 * 6
    with pytest.raises(ClpError, match="no whole training shard"):
        Rows.for_model([out], shape)


def test_prompts_are_distinct_openings_first_then_deeper_windows():
    class Chars:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    paras = ["abcdef", "abcxyz", "ab", "ghijkl"]
    got = ["".join(map(chr, p)) for p in cut_prompts(Chars(), paras, count=5, length=3, seed=0)]
    assert sorted(got[:2]) == ["abc", "ghi"] and sorted(got[2:]) == ["def", "jkl", "xyz"]
    with pytest.raises(Exception, match="gives 5 distinct prompts"):
        cut_prompts(Chars(), paras, count=6, length=3, seed=0)


def test_code_folders_are_walked_for_python_but_not_installed_packages(tmp_path):
    for name in ("b.py", "a/c.py", "site-packages/x.py", ".hidden/y.py", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    assert [p.relative_to(tmp_path).as_posix() for p in source_files("code", [str(tmp_path)])] == [
        "a/c.py",
        "b.py",
    ]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    from test_chat import write_chat_model

    return write_chat_model(tmp_path_factory.mktemp("magpie") / "tiny", ends=True)


def test_magpie_asks_from_the_user_prefix_and_answers_in_the_template(chat_folder, tmp_path):
    from test_chat import DEFAULT_SYSTEM

    model, tokenizer = load_backbone(chat_folder)
    prefix = magpie.user_prefix(tokenizer)
    assert tokenizer.decode(prefix) == DEFAULT_SYSTEM + "<|im_start|>user\n"
    out = tmp_path / "magpie"
    args = ["--model", str(chat_folder), "--out", str(out), "--kind", "magpie", "--prompts", "6",
            "--prompt-tokens", "10", "--new-tokens", "5", "--batch", "1", "--shard-size", "3",
            "--heldout", "0", "--quiet", "--seed", "3"]  # fmt: skip
    assert main(args) == 0
    stops = magpie.stop_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
    seen = 0
    for folder in store.shard_folders(out):
        a = store.load_shard(folder)
        for i, t, n, length in zip(a["index"], a["tokens"], a["prompt_len"], a["row_len"]):
            # the question is one sampling from the user prefix alone gives
            prompts = []
            for a in range(magpie.ATTEMPTS):  # one at a time, as the run's --batch 1 drew them
                key = magpie.question_key(3, int(i), a)
                q = magpie.sample_questions(model, prefix, [key], 10, stops)[0]
                prompts.append(magpie.chat_prompt(tokenizer, tokenizer.decode(q).strip()).tolist())
            assert t[:n].tolist() in prompts
            assert tokenizer.decode(t[:n].tolist()).startswith(DEFAULT_SYSTEM + "<|im_start|>user\n")
            assert (t[length:] == store.PAD).all() and length == n + 5
            seen += 1
    assert seen == 6


def test_magpie_draws_again_for_empty_or_repeated_questions(monkeypatch):
    draws = iter([[[], [1], [1], [2]], [[3], [3]], [[4]]])  # rounds of draws, in index order
    monkeypatch.setattr(magpie, "user_prefix", lambda tok: [0])
    monkeypatch.setattr(magpie, "stop_ids", lambda tok: set())
    monkeypatch.setattr(magpie, "sample_questions", lambda m, p, keys, cap, stops: next(draws))
    monkeypatch.setattr(magpie, "chat_prompt", lambda tok, q: np.array([ord(c) for c in q]))

    class Letters:
        def decode(self, ids):
            return "".join(" abcd"[i] for i in ids)

    got = magpie.magpie_prompts(None, Letters(), range(4), cap=4, batch=8, seed=0)
    assert [(i, "".join(map(chr, p))) for i, p in got] == [(0, "c"), (1, "a"), (2, "d"), (3, "b")]


def test_magpie_answers_the_questions_of_another_magpie_folder(chat_folder, tmp_path):
    common = ["--model", str(chat_folder), "--kind", "magpie", "--new-tokens", "4", "--batch", "2",
              "--shard-size", "3", "--heldout", "0.3", "--quiet"]  # fmt: skip
    asked, answered = tmp_path / "asked", tmp_path / "answered"
    assert main(common + ["--out", str(asked), "--prompts", "6", "--prompt-tokens", "8"]) == 0
    assert main(common + ["--out", str(answered), "--prompts", "5", "--data", str(asked)]) == 0

    def rows(out):
        got = {}
        for heldout in (False, True):
            for folder in store.shard_folders(out, heldout):
                a = store.load_shard(folder)
                for i, t, n, length in zip(a["index"], a["tokens"], a["prompt_len"], a["row_len"]):
                    got[int(i)] = (t[:n].tolist(), t[n:length].tolist(), heldout)
        return got

    before, after = rows(asked), rows(answered)
    # the same questions, answered greedily by the (same) model, held out alike
    assert sorted(after) == [i for i in sorted(before) if i < 5] and len(after) >= 4
    assert all(after[i] == before[i] for i in after)
    assert any(held for _, _, held in before.values())  # the held-out split is exercised


def test_magpie_refuses_questions_it_cannot_use(chat_folder, tmp_path):
    asked = tmp_path / "asked"
    args = ["--model", str(chat_folder), "--kind", "magpie", "--new-tokens", "2", "--batch", "2",
            "--shard-size", "2", "--heldout", "0", "--quiet"]  # fmt: skip
    assert main(args + ["--out", str(asked), "--prompts", "2"]) == 0
    with pytest.raises(ClpError, match="questions up to prompt 1 only; lower --prompts to 2"):
        main(args + ["--out", str(tmp_path / "b"), "--prompts", "3", "--data", str(asked)])
    manifest = json.loads((asked / "manifest.json").read_text())
    manifest["settings"]["kind"] = "wikitext"
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ClpError, match="is not magpie data"):
        main(args + ["--out", str(tmp_path / "c"), "--prompts", "1", "--data",
             str(tmp_path / "text")])
    folder = store.shard_folders(asked)[0]
    tokens = np.load(folder / "tokens.npy")
    tokens[:, 0] += 1  # no longer this template's prefix
    np.save(folder / "tokens.npy", tokens)
    with pytest.raises(ClpError, match="in another chat template"):
        main(args + ["--out", str(tmp_path / "d"), "--prompts", "1", "--data", str(asked)])
