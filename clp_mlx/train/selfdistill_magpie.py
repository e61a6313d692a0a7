"""Magpie prompts (Xu et al. 2024, arXiv 2406.08464): questions the instruct model writes.

Given only its chat template's opening of a user turn (for Qwen2.5 the
default system message, then ``<|im_start|>user\\n``), an aligned model
writes a plausible user request: the kind of text it was tuned to answer.
The question is sampled (temperature 1, top-p 0.95) up to the end-of-turn
token or ``cap`` tokens, put into the template as a real user turn, and the
row is the model's greedy answer to it: rows that look like the chat turns a
drafter meets in use.

Every question has its own PRNG key, from (seed, prompt index, attempt), and
its own noise, so it does not depend on the other rows of its batch, on the
process, or on how the work is split. An empty question, or one equal to an
earlier question of its shard, is drawn again with the next attempt's key.
Shards are made independently, so two shards can still hold the same
question: each row keeps its prompt, for a reader to drop repeats.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np

from ..errors import ClpError
from ..model import backbone

TEMPERATURE = 1.0
TOP_P = 0.95
# Top-p among the likeliest TOP_K tokens only: sorting all 152k logits of
# every row took longer than the 0.5B's forward pass; past the 1024th token
# the nucleus of a question's distribution has no measurable mass.
TOP_K = 1024
ATTEMPTS = 4  # draws per prompt index before it is given up (it then has no row)
_MARK = "\x00clp-magpie\x00"


def around_question(tokenizer) -> tuple[list[int], list[int]]:
    """The chat template's tokens before a user's text, and after it up to the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ClpError(
            "--kind magpie needs an instruct model with a chat template; this one has none"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
    )
    if text.count(_MARK) != 1:
        raise ClpError("cannot find where the user's text starts in this model's chat template")
    before, after = text.split(_MARK)
    encode = tokenizer.encode
    return encode(before, add_special_tokens=False), encode(after, add_special_tokens=False)


def user_prefix(tokenizer) -> list[int]:
    """The chat template rendered up to where the user's text starts."""
    return around_question(tokenizer)[0]


def chat_prompt(tokenizer, question: str) -> np.ndarray:
    """The template with ``question`` as the user's turn, up to the answer."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)


def inputs_digest(tokenizer) -> str:
    """What magpie prompts are made from: the template and the sampling rule."""
    what = [tokenizer.chat_template, user_prefix(tokenizer), TEMPERATURE, TOP_P, TOP_K, ATTEMPTS]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def stop_ids(tokenizer) -> set[int]:
    """Tokens that end a question: end of turn and every special token (a
    question holding ``<|im_start|>`` would open a turn of its own)."""
    ids = set(tokenizer.eos_token_ids) | set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {i for i, t in added.items() if getattr(t, "special", False)}


def question_key(seed: int, index: int, attempt: int, salt: str = "magpie") -> mx.array:
    digest = hashlib.sha256(f"{salt} {seed} {index} {attempt}".encode()).digest()
    return mx.random.key(int.from_bytes(digest[:8], "little") >> 1)


def nucleus(logits: mx.array, keys: list[mx.array]) -> mx.array:
    """A token per row, drawn by top-p among the TOP_K likeliest, row r with ``keys[r]``."""
    lp = logits.astype(mx.float32) / TEMPERATURE
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    k = min(TOP_K, lp.shape[-1])
    top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    top, vals = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    probs = mx.exp(vals)
    vals = mx.where(mx.cumsum(probs, axis=-1) - probs < TOP_P, vals, -mx.inf)
    # Gumbel-max: argmax(log p + G) is a draw from p; per-row noise keeps rows independent.
    noise = mx.stack([mx.random.gumbel((k,), key=key) for key in keys])
    pick = mx.argmax(vals + noise, axis=-1)
    return mx.take_along_axis(top, pick[:, None], axis=-1)[:, 0]


def sample_questions(model, prefix: list[int], keys: list[mx.array], cap: int, stops: set[int]):
    """One question's token ids per key, all continuing ``prefix`` as one batch."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    h = model.model(mx.array([prefix] * len(keys)), cache=cache)[:, -1]
    step_keys = [mx.random.split(key, cap) for key in keys]
    out: list[list[int]] = [[] for _ in keys]
    open_rows = [True] * len(keys)
    for t in range(cap):
        drawn = nucleus(backbone.project(model, h), [k[t] for k in step_keys])
        for r, token in enumerate(drawn.tolist()):
            if open_rows[r] and token in stops:
                open_rows[r] = False
            elif open_rows[r]:
                out[r].append(token)
        if not any(open_rows) or t + 1 == cap:
            break
        h = model.model(drawn[:, None], cache=cache)[:, -1]
    return out


def draw_prompts(model, indices, prefix, stops, *, cap, batch, seed, salt, norm) -> dict:
    """{index: norm(ids)}: one sampled continuation of ``prefix`` per prompt index,
    drawn again with the next attempt's key when ``norm`` makes it empty or equal
    to one an earlier index kept; an index whose every attempt failed has none."""
    chosen: dict = {}
    seen: set = set()
    pending = [(i, 0) for i in indices]
    while pending:
        drawn = []
        for b in range(0, len(pending), batch):
            part = pending[b : b + batch]
            keys = [question_key(seed, i, a, salt) for i, a in part]
            drawn.extend(zip(part, sample_questions(model, prefix, keys, cap, stops)))
        pending = []
        for (i, attempt), ids in drawn:  # index order: the first of equal draws keeps it
            value = norm(ids)
            if value and value not in seen:
                chosen[i] = value
                seen.add(value)
            elif attempt + 1 < ATTEMPTS:
                pending.append((i, attempt + 1))
    return chosen


def magpie_prompts(
    model, tokenizer, indices, *, cap: int, batch: int, seed: int
) -> list[tuple[int, np.ndarray]]:
    """(index, chat prompt) for the prompt ``indices`` of one shard, in order;
    an index whose every attempt was empty or a repeat has none."""
    prefix, stops = user_prefix(tokenizer), stop_ids(tokenizer)
    chosen = draw_prompts(
        model, indices, prefix, stops, cap=cap, batch=batch, seed=seed, salt="magpie",
        norm=lambda ids: tokenizer.decode(ids).strip(),
    )  # fmt: skip
    return [(i, chat_prompt(tokenizer, chosen[i])) for i in sorted(chosen)]


def asked_prompts(tokenizer, folders: list[str], count: int) -> tuple[dict[int, np.ndarray], str]:
    """The chat prompts of prompt indices ``0..count-1`` in magpie data
    ``folders`` already made (e.g. by a smaller model of the same family,
    whose questions cost a larger one most of its time to write), and a
    sha256 of them. Every prompt must be in this tokenizer's chat template:
    the same prefix before the question and the same opening of the answer."""
    from pathlib import Path

    from . import selfdistill_store as store

    prefix, tail = around_question(tokenizer)
    prompts: dict[int, np.ndarray] = {}
    for given in folders:
        folder = Path(given)
        kind = store.read_manifest(folder).get("settings", {}).get("kind")
        if kind != "magpie":
            raise ClpError(f"{given} is not magpie data (its kind is {kind!r}): no questions in it")
        for shard in store.shard_folders(folder) + store.shard_folders(folder, heldout=True):
            a = store.load_shard(shard)
            for i, t, n in zip(a["index"], a["tokens"], a["prompt_len"]):
                p = np.asarray(t[:n], dtype=np.int32)
                if p[: len(prefix)].tolist() != prefix or p[len(p) - len(tail) :].tolist() != tail:
                    raise ClpError(f"{given}: its questions are in another chat template")
                if int(i) < count:
                    prompts.setdefault(int(i), p)
    top = max(prompts, default=-1)
    if top < count - 1:
        raise ClpError(
            f"the magpie data given holds questions up to prompt {top} only; "
            f"lower --prompts to {top + 1} or make more questions"
        )
    digest = hashlib.sha256(b"magpie questions\0")
    for i in sorted(prompts):
        digest.update(i.to_bytes(8, "little") + prompts[i].astype("<i4").tobytes())
    return prompts, digest.hexdigest()
