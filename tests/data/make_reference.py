"""Make the Qwen2.5-Coder-0.5B reference that tests/test_reference_qwen05.py checks against.

Uses only transformers and torch: transformers reads the GGUF file itself
(dequantizing the weights into fp32 torch tensors, and building the tokenizer
from the GGUF vocabulary), so the reference shares no code with clp_mlx's
converter or with mlx. Needs torch, transformers (>= 4.56, for ``dtype=``),
accelerate (transformers' GGUF loader asks for it) and gguf.

    python tests/data/make_reference.py \\
        --gguf <path-to>/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --wikitext <path-to>/wikitext-2-raw/wiki.test.raw \\
        --stdlib <path-to>/lib/python3.11 \\
        --out tests/data/reference_qwen2.5-coder-0.5b.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import transformers
from tokenizers import normalizers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 24
TOP_K = 20
# Continuation offsets whose logits are kept: 0 is the last prompt position
# (it predicts the first new token); 12 and 23 are teacher-forced on the
# greedy tokens, so errors that grow with the KV length show too.
LOGIT_OFFSETS = (0, 12, 23)
N_WIKI, N_WIKI_UNICODE = 180, 20  # 200 WikiText lines, 20 of them chosen for non-ASCII text
CODE_FILES = ("textwrap.py", "heapq.py", "string.py", "fractions.py",
              "difflib.py", "functools.py", "argparse.py", "json/encoder.py")
CODE_LINES_PER_FILE = 12  # 96 single lines, plus one multi-line block per file
CODE_BLOCK_LINES = 8

# Strings where tokenizers commonly differ: special tokens inside text, Unicode
# normalization (Qwen normalizes to NFC, so NFD "é" must give the NFC ids),
# emoji split into bytes, CJK, CR/LF, tabs, runs of spaces, and digits (Qwen
# splits numbers into single digits).
TRICKY = [
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text before<|endoftext|>text after",
    "<|im_start|><|im_end|><|im_start|>",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
    "caf\u00e9 (NFC)",
    "cafe\u0301 (NFD)",
    "\u00c5ngstr\u00f6m vs A\u030angstro\u0308m",
    "emoji: \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f600\U0001f680",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\ud55c\uad6d\uc5b4",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 "  # Arabic
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439 "  # Cyrillic
    "\u03ba\u03cc\u03c3\u03bc\u03b5",  # Greek
    "line one\r\nline two\r\n\r\n",
    "\tone tab\t\ttwo tabs\n\t\tindented",
    "a  b   c    d     e",
    "   leading and trailing   ",
    "\n\n\nthree newlines\n\n",
    "12345 1234567890 3.14159 -42 1e-10 0x1F 1,000,000",
    "don't I'll we're they've it's CAN'T",
    "if (x != y && z <= 3) { return a->b; }  // C",
    "    def f(self, *args, **kwargs) -> None:\n        pass\n",
    "\u00a0non-breaking\u00a0space and \u2009thin\u2009space",
    "",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def evenly(items: list, n: int) -> list:
    """n items spread evenly over the list, first one included (deterministic)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def wikitext_lines(path: Path) -> list[str]:
    """Non-empty lines (without their newline): every Nth, plus some non-ASCII ones."""
    lines = [s for s in path.read_text(encoding="utf-8").split("\n") if s.strip()]
    chosen = set(evenly(range(len(lines)), N_WIKI))
    unicode_rest = [i for i in range(len(lines)) if not lines[i].isascii() and i not in chosen]
    chosen |= set(evenly(unicode_rest, N_WIKI_UNICODE))
    return [lines[i] for i in sorted(chosen)]


def code_lines(stdlib: Path) -> list[dict]:
    """Single lines (indentation kept) and one multi-line block from each file."""
    out = []
    for name in CODE_FILES:
        lines = (stdlib / name).read_text(encoding="utf-8").split("\n")
        nonempty = [s for s in lines if s.strip()]
        out += [{"source": name, "text": s} for s in evenly(nonempty, CODE_LINES_PER_FILE)]
        # The first def with its body: "\n" followed by runs of spaces is where
        # code tokenization is most particular.
        start = next(i for i, s in enumerate(lines) if s.lstrip().startswith("def "))
        block = "\n".join(lines[start:start + CODE_BLOCK_LINES]) + "\n"
        out.append({"source": f"{name} (block)", "text": block})
    return out


def prompts(tok, wiki_path: Path) -> list[dict]:
    # A WikiText sentence: the first paragraph line of the test set, up to its
    # first full stop (the raw text has " ." with a space before it).
    first_par = next(s for s in wiki_path.read_text(encoding="utf-8").split("\n")
                     if s.strip() and not s.strip().startswith("="))
    wiki_sentence = first_par[: first_par.index(" . ") + 2]
    question = "Write a Python function that checks whether a number is prime."
    chat = tok.apply_chat_template([{"role": "user", "content": question}],
                                   tokenize=False, add_generation_prompt=True)
    return [
        {"name": "france", "text": "The capital of France is"},
        {"name": "quicksort", "text": "def quicksort(arr):"},
        {"name": "numpy_mean", "text": "import numpy as np\n\n# compute the mean of"},
        {"name": "wikitext", "text": wiki_sentence},
        {"name": "story", "text": "Once upon a time"},
        {"name": "chat", "text": chat},
    ]


def round_list(values, digits: int) -> list[float]:
    return [round(float(v), digits) for v in values]


@torch.no_grad()
def model_reference(model, tok, prompt: dict) -> dict:
    ids = tok.encode(prompt["text"])
    x = torch.tensor([ids])
    # eos_token_id=None: keep going past <|im_end|>, as clp_mlx's decoder does.
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                         do_sample=False, eos_token_id=None)
    greedy = out[0, len(ids):].tolist()
    assert len(greedy) == NEW_TOKENS, greedy

    # One full forward pass (no KV cache) over the prompt and the greedy tokens:
    # the logits at prompt position P-1+k predict greedy[k].
    logits = model(torch.tensor([ids + greedy[:-1]]), use_cache=False).logits[0, len(ids) - 1:]
    top2 = logits.topk(2, dim=-1).values
    positions = []
    for k in LOGIT_OFFSETS:
        row = logits[k]
        top = row.topk(TOP_K)
        positions.append({
            "offset": k,
            "top_ids": top.indices.tolist(),
            "top_logits": round_list(top.values, 5),
            "logsumexp": round(float(torch.logsumexp(row, dim=-1)), 5),
        })
    return {
        **prompt,
        "ids": ids,
        "greedy": greedy,
        # generate() uses a KV cache, the pass above does not; both must agree.
        "greedy_is_argmax": logits.argmax(-1).tolist() == greedy,
        # Top-1 minus top-2 logit at each greedy step: a small gap is a near-tie
        # that rounding differences between two fp32 implementations may flip.
        "margins": round_list(top2[:, 0] - top2[:, 1], 4),
        "positions": positions,
    }


def token_reference(tok, kind: str, text: str, source: str | None = None) -> dict:
    ids = tok.encode(text)  # Qwen adds no BOS; special tokens in the text are parsed
    entry = {"kind": kind, "text": text, "ids": ids, "roundtrip": tok.decode(ids) == text}
    if source:
        entry["source"] = source
    return entry


def dump(data: dict, path: Path) -> None:
    """JSON with one record per line: compact, yet diffs stay readable."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            body = ",\n".join(json.dumps(v, separators=(",", ":")) for v in value)
            parts.append(f"{json.dumps(key)}: [\n{body}\n]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, indent=1)}")
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n", encoding="ascii")


def command_line(args) -> str:
    """The command as run, with local folders replaced by placeholders."""
    return " ".join([
        "python", "tests/data/make_reference.py",
        "--gguf", f"<path-to>/{args.gguf.name}",
        "--wikitext", f"<path-to>/{args.wikitext.name}",
        "--stdlib", f"<path-to>/lib/{args.stdlib.name}",
        "--out", f"tests/data/{args.out.name}",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, required=True,
                   help="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    p.add_argument("--wikitext", type=Path, required=True, help="WikiText-2 raw wiki.test.raw")
    p.add_argument("--stdlib", type=Path, required=True, help="a CPython standard library folder")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).with_name("reference_qwen2.5-coder-0.5b.json"))
    args = p.parse_args()

    folder, name = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok_as_loaded = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers' own Qwen2Tokenizer normalizes text to NFC (as Qwen's
    # tokenizer.json does), but its GGUF loader builds the tokenizer without
    # that step: put it back. Where this changes the ids, the entry keeps the
    # loader's ids too ("ids_gguf_loader"), so the choice stays visible.
    nfc_added = tok.backend_tokenizer.normalizer is None
    if nfc_added:
        tok.backend_tokenizer.normalizer = normalizers.NFC()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    results = []
    for prompt in prompts(tok, args.wikitext):
        results.append(model_reference(model, tok, prompt))
        r = results[-1]
        print(f"{r['name']}: greedy is argmax: {r['greedy_is_argmax']}, "
              f"smallest margin {min(r['margins']):.4f}, "
              f"{tok.decode(r['greedy'])!r}", file=sys.stderr)

    tokens = [token_reference(tok, "wikitext", s) for s in wikitext_lines(args.wikitext)]
    tokens += [token_reference(tok, "code", c["text"], c["source"])
               for c in code_lines(args.stdlib)]
    tokens += [token_reference(tok, "tricky", s) for s in TRICKY]
    for entry in tokens:
        loader_ids = tok_as_loaded.encode(entry["text"])
        if loader_ids != entry["ids"]:
            entry["ids_gguf_loader"] = loader_ids

    meta = {
        "command": command_line(args),
        "gguf": args.gguf.name,
        "gguf_sha256": sha256(args.gguf),
        "wikitext_sha256": sha256(args.wikitext),
        "stdlib_python": args.stdlib.name,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "tokenizers": version("tokenizers"), "gguf": version("gguf")},
        "tokenizer_nfc_added": nfc_added,
        "tokenizer_note": "ids: the GGUF tokenizer with NFC normalization, as Qwen2Tokenizer "
                          "and Qwen's tokenizer.json have it; ids_gguf_loader (only where "
                          "different): transformers' GGUF loader as is, without NFC",
        "dtype": "float32",
        "new_tokens": NEW_TOKENS,
        "top_k": TOP_K,
        "logits_note": "positions[].offset k: logits at prompt position len(ids)-1+k, "
                       "input = ids + greedy[:k] (teacher-forced on the greedy tokens)",
    }
    dump({"meta": meta, "prompts": results, "tokens": tokens}, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB, "
          f"{len(tokens)} tokenizer lines)", file=sys.stderr)


if __name__ == "__main__":
    main()
