"""A chat's conversation: its tokens, the KV cache that holds them, and the
pieces of the chat template that turns are built from (see :mod:`.chat`)."""

from __future__ import annotations

from ..api import Response
from ..decode.layer_cache import held, make_prompt_cache, trim_to
from ..errors import ClpError
from ..model.tokens import check_text

_MARK = "CLP-MLX-MARK-7f3a"  # placeholder content, to cut the template into pieces


def template_pieces(tokenizer) -> tuple[str, str, str]:
    """What closes an assistant message, opens a user turn, and starts the reply.

    For Qwen2.5: ``<|im_end|>\\n``, ``<|im_start|>user\\n`` and
    ``<|im_end|>\\n<|im_start|>assistant\\n``; cut from the model's own
    template by rendering placeholder conversations one turn apart.
    """

    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    head = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _MARK},
    ]
    before = render(head, False)
    after = render([*head, {"role": "user", "content": _MARK}], True)
    turn = after[len(before) :]
    if not after.startswith(before) or before.count(_MARK) != 1 or turn.count(_MARK) != 1:
        raise ClpError("cannot cut this model's chat template into turns")
    opening, reply = turn.split(_MARK)
    return before[before.index(_MARK) + len(_MARK) :], opening, reply


class Conversation:
    """A conversation's tokens and the KV cache that holds them.

    ``tokens``: every committed token, turns as the template renders them and
    answers as decoded. The cache holds the first ``cached`` of them; the
    rest (``unfed``) go in with the next turn.
    """

    def __init__(self, model, tokenizer, system_prompt: str | None = None, heads=None):
        self.model, self.tokenizer, self.system_prompt = model, tokenizer, system_prompt
        self.heads = heads  # an MTP layer's keys are kept with the backbone's
        self.close, self.opening, self.reply = template_pieces(tokenizer)
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.cache = make_prompt_cache(self.model, self.heads)
        self.turns: list[tuple[int, int, Response]] = []  # (new, carried over, last response)

    @property
    def cached(self) -> int:
        return held(self.cache)

    @property
    def unfed(self) -> list[int]:
        return self.tokens[self.cached :]

    def _closed_by(self) -> str:
        """The start of ``close`` that the last answer's end token already wrote."""
        if self.tokens and self.tokens[-1] in self.tokenizer.eos_token_ids:
            end = self.tokenizer.decode([self.tokens[-1]])
            if end and self.close.startswith(end):
                return end
        return ""

    def begin_turn(self, text: str) -> list[int]:
        """The tokens of a user turn: from closing the last answer to the reply's start."""
        check_text(text, "this message")
        if not self.tokens:
            messages = [{"role": "user", "content": text}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:
            rendered = self.close[len(self._closed_by()) :] + self.opening + text + self.reply
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def end_answer(self) -> None:
        """Trim the cache to the committed tokens, which decoding overran.

        Decoding queues the next pass before handing out tokens, so the cache
        may hold drafts or tokens past the stop. Layers are trimmed one by one:
        a second Ctrl-C may have stopped a pass between two layers.
        """
        eos = self.tokenizer.eos_token_ids
        if self.tokens and self.tokens[-1] in eos and not self._closed_by():
            self.tokens.pop()  # an end token the template does not close with (<|endoftext|>)
        trim_to(self.cache, min(len(self.tokens), self.cached))

    def summary(self, limit: int) -> str:
        lines = [f"{len(self.turns)} turns, {len(self.tokens)} of {limit} tokens in the context"]
        tokens = passes = 0
        for i, (new, carried, r) in enumerate(self.turns, start=1):
            tokens, passes = tokens + r.stats.tokens, passes + r.stats.steps
            lines.append(f"turn {i}: {turn_line(new, carried, r)}")
        if passes:
            lines.append(f"all turns: {tokens / passes:.2f} tokens per backbone pass")
        return "\n".join(lines)


def turn_line(new: int, carried: int, r: Response) -> str:
    return (
        f"prefill {new + carried} tokens ({new} new + {carried} carried over) | "
        f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tokens/s | "
        f"{r.stats.tokens_per_step:.2f} tokens per backbone pass | mode {r.stats.mode}"
    )
