"""The benchmark's prompts: WikiText openings or instruction files, and their token ids.

Two kinds of prompt, encoded differently:

- ``wikitext``: the first paragraph of each WikiText-2 article, a document
  opening to be continued. Cut to the first ``--prompt-tokens`` tokens.
- ``instruction``: a request to answer, from a JSONL file (``prompt`` or
  MT-Bench's ``turns``, first turn) or a text file with one per line. Kept
  whole; wrapped in the tokenizer's chat template when it has one.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..model.tokens import encode
from ..errors import ClpError

CHAT_TEMPLATE_CHOICES = ("auto", "always", "never")


def _read(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ClpError(f"prompt file {path} does not exist")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ClpError(f"prompt file {path} is not UTF-8 text: {e}") from None


def wikitext_prompts(path: str, n: int) -> list[str]:
    """First paragraph of each of the first ``n`` articles (' = Title = ' lines)."""
    prompts, in_article = [], False
    for line in _read(path).splitlines():
        s = line.strip()
        if s.startswith("= ") and s.endswith(" =") and not s.startswith("= ="):
            in_article = True
        elif in_article and s and not s.startswith("="):
            prompts.append(s)
            in_article = False
            if len(prompts) == n:
                break
    if not prompts:
        raise ClpError(f"{path} holds no WikiText articles (' = Title = ' lines)")
    return prompts


def _json_object(line: str):
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _prompt_of(record: dict, where: str) -> str:
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ClpError(f"{where}: 'prompt' must be a non-empty string")
        return text
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ClpError(f"{where}: 'turns' must be a non-empty list of strings")
        if not isinstance(turns[0], str) or not turns[0].strip():
            raise ClpError(f"{where}: the first of 'turns' must be a non-empty string")
        return turns[0]
    raise ClpError(f"{where}: the object has neither 'prompt' nor 'turns'")


def instruction_prompts(path: str, n: int | None = None) -> list[str]:
    """Prompts from a JSONL or plain-text file (see the module docstring).

    The file is JSONL when its name ends in ``.jsonl`` or when every
    non-empty line is a JSON object; otherwise each non-empty line is a prompt.
    """
    lines = [(i, s) for i, s in enumerate(_read(path).splitlines(), start=1) if s.strip()]
    if not lines:
        raise ClpError(f"prompt file {path} is empty")
    objects = [_json_object(s) for _, s in lines]
    if path.lower().endswith(".jsonl") or all(o is not None for o in objects):
        prompts = []
        for (number, _), record in zip(lines, objects):
            where = f"{path}, line {number}"
            if record is None:
                raise ClpError(f"{where}: not a JSON object")
            prompts.append(_prompt_of(record, where))
    else:
        prompts = [s.strip() for _, s in lines]
    return prompts[:n] if n is not None else prompts


def bench_texts(wikitext: str | None, files: list[str] | None, n: int) -> tuple[list[str], str]:
    """The first ``n`` prompts and their kind: WikiText-2 openings of ``wikitext``
    if given, else the instructions of ``files``, one file after another."""
    if wikitext:
        return wikitext_prompts(wikitext, n), "wikitext"
    return [t for f in files for t in instruction_prompts(f)][:n], "instruction"


def has_chat_template(tokenizer) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)  # mlx-lm's wrapper says so
    if flag is not None:
        return bool(flag)
    return getattr(tokenizer, "chat_template", None) is not None


def uses_chat_template(kind: str, rule: str) -> bool:
    """``auto``: instructions get the template, WikiText openings never do."""
    if rule not in CHAT_TEMPLATE_CHOICES:
        raise ClpError(f"--chat-template must be one of {', '.join(CHAT_TEMPLATE_CHOICES)}")
    return rule == "always" or (rule == "auto" and kind == "instruction")


def encode_prompts(
    tokenizer,
    prompts: list[str],
    kind: str,
    *,
    chat_template: str = "auto",
    prompt_tokens: int = 64,
) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the chat template was applied.

    WikiText prompts are cut to their first ``prompt_tokens`` tokens (before
    templating, when ``always`` asks for it); instruction prompts are whole.
    Under ``auto`` a tokenizer without a chat template encodes plain text;
    ``always`` with such a tokenizer is an error.
    """
    if kind not in ("wikitext", "instruction"):
        raise ValueError(f"unknown prompt kind {kind!r}")
    template = uses_chat_template(kind, chat_template)
    if template and not has_chat_template(tokenizer):
        if chat_template == "always":
            raise ClpError("--chat-template always: this model's tokenizer has no chat template")
        template = False
    encoded = []
    for text in prompts:
        if kind == "wikitext":
            ids = encode(tokenizer, text)[:prompt_tokens]
            if template:
                text = tokenizer.decode(ids)
        if template:
            messages = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        elif kind == "instruction":
            ids = encode(tokenizer, text)
        if not ids:
            raise ClpError(f"the prompt {text[:40]!r} encodes to no tokens")
        encoded.append(list(ids))
    return encoded, template
