"""The benchmark's prompts, methods, metrics and files (numbers are not asserted, only meaning)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_pairs, FakeTokenizer, random_heads, tiny_model, write_model_folder

from clp_mlx.cli.bench import bench, main, repetition_ratio, settings, wikitext_prompts
from clp_mlx.bench.measures import continuation_nll
from clp_mlx.bench.methods import Start, run_one
from clp_mlx.bench.prompts import encode_prompts, instruction_prompts
from clp_mlx.bench.report import plots, write_json
from clp_mlx.errors import ClpError

ARTICLES = """ = First article =

 First paragraph of one .

 = = Section = =

 More text .
 = Second article =

 Opening of two .
"""
PNG = b"\x89PNG\r\n\x1a\n"


def test_prompts_are_first_paragraphs_of_articles(tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(ARTICLES)
    assert wikitext_prompts(str(path), 5) == ["First paragraph of one .", "Opening of two ."]


def test_instruction_files_jsonl_turns_and_plain_text(tmp_path):
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"prompt": "Say hi"}\n\n{"turns": ["First turn", "second"], "id": 3}\n')
    assert instruction_prompts(str(jsonl)) == ["Say hi", "First turn"]
    # Not named .jsonl, but every line is a JSON object: still JSONL.
    objects = tmp_path / "q.txt"
    objects.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert instruction_prompts(str(objects), 1) == ["a"]
    plain = tmp_path / "plain.txt"
    plain.write_text('Write a poem.\n\n{"prompt": "x"}\n  Explain MLX.  \n')
    assert instruction_prompts(str(plain)) == ["Write a poem.", '{"prompt": "x"}', "Explain MLX."]


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "line 3: not a JSON object"),
        ("[1, 2]", "line 3: not a JSON object"),
        ('{"question": "x"}', "line 3: .*neither 'prompt' nor 'turns'"),
        ('{"turns": []}', "line 3: 'turns' must be"),
        ('{"prompt": 5}', "line 3: 'prompt' must be"),
    ],
)
def test_bad_jsonl_lines_name_their_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{line}\n')
    with pytest.raises(ClpError, match=message):
        instruction_prompts(str(path))


class TemplateTokenizer(FakeTokenizer):
    chat_template = "<user>{content}<assistant>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and messages[0]["role"] == "user"
        return f"<u>{messages[0]['content']}<a>"

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_chat_template_rule_and_prompt_cut():
    tok, text = TemplateTokenizer(), "abcdefgh"
    ids, templated = encode_prompts(tok, [text], "instruction", prompt_tokens=3)
    assert templated and ids == [tok.encode("<u>abcdefgh<a>")]  # whole, templated
    ids, templated = encode_prompts(tok, [text], "wikitext", prompt_tokens=3)
    assert not templated and ids == [tok.encode("abc")]  # cut, never templated
    ids, _ = encode_prompts(tok, [text], "wikitext", chat_template="always", prompt_tokens=3)
    assert ids == [tok.encode("<u>abc<a>")]
    ids, _ = encode_prompts(tok, [text], "instruction", chat_template="never", prompt_tokens=3)
    assert ids == [tok.encode(text)]
    ids, templated = encode_prompts(FakeTokenizer(), [text], "instruction")
    assert not templated and ids == [FakeTokenizer().encode(text)]  # no template: plain
    with pytest.raises(ClpError, match="no chat template"):
        encode_prompts(FakeTokenizer(), [text], "instruction", chat_template="always")


def test_repetition_ratio():
    assert repetition_ratio([1, 2, 3, 4, 5]) == 0.0
    assert repetition_ratio([7, 7, 7, 7, 7]) == 1 - 1 / 3
    assert repetition_ratio([1, 2]) == 0.0


def test_perplexity_matches_a_hand_computation(model):
    prompt, generated = [5, 17, 99], [3, 3, 60, 1]
    nll = 0.0
    for i, tok in enumerate(generated):  # a fresh full pass per position
        logits = np.array(model(mx.array([prompt + generated[:i]]))[0, -1], dtype=np.float64)
        nll -= logits[tok] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert continuation_nll(model, prompt, generated) == pytest.approx(nll, rel=1e-4)
    perplexity = np.exp(continuation_nll(model, prompt, generated) / len(generated))
    assert perplexity == pytest.approx(np.exp(nll / 4), rel=1e-4)
    start = Start.prefill(model, prompt)
    assert continuation_nll(model, prompt, generated, start) == pytest.approx(nll, rel=1e-4)
    assert start.cache[0].offset == len(prompt) - 1  # rewound for the next method


def test_methods_from_one_prefill_match_fresh_decoding(model):
    """Every method starts from the same prefilled cache, rewound after each."""
    heads = random_heads(model, 2, seed=2, scale=0.3)
    ids = FakeTokenizer().encode("hello there")
    start = Start.prefill(model, ids)
    for mode in ("ar", "verify", "fixed", "ar"):
        fresh = [t for t, _ in decode_pairs(ids, model, heads, mode=mode, max_tokens=10)]
        assert run_one(model, heads, start, mode, 10).tokens == fresh, mode
        assert start.cache[0].offset == len(ids) - 1


def test_ours_and_mlx_lm_peers_are_identical_to_ar(model):
    heads = random_heads(model, 2, seed=2, scale=0.3)
    draft = tiny_model(seed=1, layers=1)
    prompts = [FakeTokenizer().encode(p) for p in ("abc", "hello")]
    modes = ["ar", "verify", "verify-clp", "verify-all", "fixed", "gate", "prior-mtp"]
    modes += ["mlx-lm", "mlx-lm-draft"]
    table = bench(model, heads, prompts, modes, max_tokens=12, draft=draft, draft_tokens=3)
    assert list(table) == modes and table["ar"]["speedup"] == 1.0
    for m in ("verify", "verify-clp", "verify-all", "mlx-lm", "mlx-lm-draft"):
        assert table[m]["identical_to_ar"] == 1.0 and table[m]["lossless"], m
        assert table[m]["mean_common_prefix"] == 12.0
        assert table[m]["perplexity"] == table["ar"]["perplexity"]  # same tokens, same pass
    assert not table["fixed"]["lossless"]
    assert table["fixed"]["tokens_per_pass"] == 3.0  # 12 tokens, 3 per pass
    assert table["mlx-lm"]["tokens_per_pass"] == 1.0
    hist = table["mlx-lm-draft"]["accepted_histogram"]
    assert len(hist) == 4 and sum(n * c for n, c in enumerate(hist)) + sum(hist) == 24
    for r in table.values():
        assert r["prefill_s"] > 0 and r["first_token_s"] > 0 and r["peak_memory_gb"] > 0
        assert r["perplexity"] >= 1


def test_a_draft_model_equal_to_the_target_is_always_accepted(model):
    table = bench(model, None, [[1, 2, 3]], ["mlx-lm-draft"], max_tokens=12, draft=model)
    assert table["mlx-lm-draft"]["accepted_histogram"] == [0, 0, 0, 3]
    assert table["mlx-lm-draft"]["tokens_per_pass"] == 4.0


def test_quick_sets_its_defaults_and_explicit_options_win(tmp_path):
    args = settings(["--quick", "--wikitext", "w.raw"])
    assert (args.num_prompts, args.max_tokens, args.modes, args.repeats) == (
        3,
        32,
        ["ar", "verify", "clp"],
        1,
    )
    assert settings(["--quick", "--prompts", "p.txt", "-m", "9"]).max_tokens == 9
    with pytest.raises(ClpError, match="exactly one"):
        settings(["--quick"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--modes", "ar", "beam"], "unknown method 'beam'"),
        (["--modes", "ar", "fixed@0.5"], "unknown method 'fixed@0.5'"),
        (["--modes", "ar", "clp@2"], "must be a number in"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["-m", "0"], "--max-tokens must be at least 2"),
        (["--modes", "ar", "mlx-lm-draft"], "--draft-model"),
        (["--chat-template", "sometimes"], "--chat-template"),
        (["--json", "/no/such/dir/out.json"], "--json"),
    ],
)
def test_bad_options_are_clear_errors(tmp_path, extra, message):
    # A model that does not exist: if a check were missing, loading fails otherwise.
    argv = ["--model", str(tmp_path / "none"), "--prompts", __file__, *extra]
    with pytest.raises(ClpError, match=message):
        main(argv)


def test_bad_prompt_files_are_clear_errors(tmp_path):
    missing = str(tmp_path / "none")
    with pytest.raises(ClpError, match="does not exist"):
        main(["--model", missing, "--wikitext", str(tmp_path / "missing.raw")])
    with pytest.raises(ClpError, match="does not exist"):
        main(["--model", missing, "--prompts", str(tmp_path / "missing.jsonl")])
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(ClpError, match="is empty"):
        main(["--model", missing, "--prompts", str(tmp_path / "empty.txt")])
    with pytest.raises(ClpError, match="exactly one"):
        main([])


def test_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "out.json"
    write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_plots_are_skipped_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    assert plots([], tmp_path / "p") == []
    assert "matplotlib" in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_cli_runs_two_models_and_writes_json_and_plots(tmp_path, capsys):
    target = write_model_folder(tmp_path / "target", tiny_model(0))
    draft = write_model_folder(tmp_path / "draft", tiny_model(1, layers=1))
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"prompt": "ab"}\n{"turns": ["cd", "ef"]}\n')
    out = tmp_path / "bench.json"
    modes = ["ar", "verify", "clp", "mlx-lm", "mlx-lm-draft"]
    argv = ["--model", str(target), str(draft), "--heads", "init", "--prompts", str(prompts)]
    argv += ["--modes", *modes, "--draft-model", str(draft), "-m", "8", "--json", str(out)]
    assert main([*argv, "--plots", str(tmp_path / "plots")]) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("| method |") == 2 and "peak memory" in stdout
    report = json.loads(out.read_text())
    first, second = report["models"]
    assert list(first["results"]) == modes and first["k"] == 3 and first["heads"] == "init"
    assert first["results"]["mlx-lm-draft"]["identical_to_ar"] == 1.0
    assert "mlx-lm-draft" not in second["results"] and "draft model" in second["notes"][0]
    assert first["weights_dtype"] == "float32" and not first["chat_template"]
    env = report["env"]
    for key in ("machine", "system", "processor", "python", "mlx", "mlx_lm", "device", "blas"):
        assert key in env
    assert report["prompts"] == {"file": str(prompts), "kind": "instruction", "count": 2}
    for name in ("speedup-vs-quality.png", "accepted-lengths.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(PNG)


def test_models_without_heads(tmp_path, capsys):
    one = write_model_folder(tmp_path / "one", tiny_model(0))
    two = write_model_folder(tmp_path / "two", tiny_model(1, layers=1))
    (tmp_path / "p.txt").write_text("ab\n")
    modes = ["ar", "verify", "clp", "verify-heads", "mlx-lm"]
    argv = ["--prompts", str(tmp_path / "p.txt"), "--modes", *modes, "-m", "4"]
    with pytest.raises(ClpError, match="clp needs heads"):
        main(["--model", str(one), *argv])  # one model: a mistake to fix
    out = tmp_path / "out.json"
    assert main(["--model", str(one), str(two), *argv, "--json", str(out)]) == 0
    for entry in json.loads(out.read_text())["models"]:  # several: skipped, with a note
        # verify runs on context drafts; what needs heads is skipped
        assert list(entry["results"]) == ["ar", "verify", "mlx-lm"] and entry["heads"] is None
        assert entry["results"]["verify"]["identical_to_ar"] == 1.0
        assert "skipped clp, verify-heads" in entry["notes"][0]
    assert "note: skipped clp, verify-heads" in capsys.readouterr().out


def test_bench_step_reports_the_pass_widths_and_the_host_work(tmp_path, capsys):
    from clp_mlx.cli import bench_step

    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    assert bench_step.main(["--model", str(folder), "--repeats", "1", "--context", "8"]) == 0
    out = capsys.readouterr().out
    for row in (
        "backbone x1",
        "backbone x4",
        "verify step (4 fed)",
        "heads' drafts after the pass",
    ):
        assert f"| {row} |" in out, row
    assert "| detokenize one token |" in out and "| context drafter (extend + propose) |" in out


def test_bench_step_times_an_mtp_layers_pass_and_its_drafting(tmp_path, capsys):
    from clp_mlx.cli import bench_step
    from clp_mlx.model.heads_files import init_heads, save_heads
    from clp_mlx.model.mtp_layer import MTPLayer

    model = tiny_model(0, layers=3)
    folder = write_model_folder(tmp_path / "tiny", model)
    layer = MTPLayer(model.args, 32, side_layers=(1, 2)).shape()  # reads earlier layers too
    drafter = save_heads(
        init_heads(model, 3, design="mtp", gate=False, head0=False, layer=layer), tmp_path / "mtp"
    )
    argv = ["--model", str(folder), "--heads", str(drafter), "--repeats", "2", "--context", "8"]
    assert bench_step.main(argv) == 0
    out = capsys.readouterr().out
    for row in (
        "backbone x1",
        "backbone x4",
        "verify pass (4 fed)",
        "MTP layer after 1 accepted (3 depths)",
        "MTP layer after 4 accepted (3 depths)",
        "build a verify step's graph (chain)",
    ):
        assert f"| {row} |" in out, row
    assert "heads' drafts after the pass" not in out  # chain heads' rows only
    assert "verify, 4 fed and all accepted: pass + the layer" in out


def test_bench_step_leaves_both_caches_as_they_were_after_timing_the_layer(tmp_path):
    from mlx_lm.models.cache import make_prompt_cache

    from clp_mlx.cli import bench_step
    from clp_mlx.decode.mtp_drafter import MTPDrafter
    from clp_mlx.model.heads_files import init_heads
    from clp_mlx.model.mtp_layer import MTPLayer

    model = tiny_model(0, layers=3)
    layer = MTPLayer(model.args, 32, side_layers=(1, 2)).shape()
    heads = init_heads(model, 3, design="mtp", gate=False, head0=False, layer=layer)
    cache, drafter = make_prompt_cache(model), MTPDrafter(model, heads)
    history = mx.arange(8, dtype=mx.uint32)
    drafter.prompt(model.model(history[None], cache=cache)[0], history)
    for n in (1, 4):
        assert bench_step._drafting(model, drafter, cache, n) > 0
        assert cache[0].offset == 8 and drafter.cache.offset == 8 and drafter.offset == 8


def test_several_prompt_files_are_benched_one_after_another(tmp_path):
    folder = write_model_folder(tmp_path / "tiny", tiny_model(0))
    (tmp_path / "a.txt").write_text("ab\ncd\n")
    (tmp_path / "b.jsonl").write_text('{"prompt": "ef"}\n')
    out = tmp_path / "out.json"
    argv = ["--model", str(folder), "--modes", "ar", "-m", "2", "--json", str(out)]
    assert main([*argv, "--prompts", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]) == 0
    report = json.loads(out.read_text())
    assert report["prompts"]["count"] == 3 and report["prompts"]["file"].endswith("b.jsonl")
    assert main([*argv, "--num-prompts", "2", "--prompts", str(tmp_path / "b.jsonl"),
                 str(tmp_path / "a.txt")]) == 0  # fmt: skip
    assert json.loads(out.read_text())["prompts"]["count"] == 2
