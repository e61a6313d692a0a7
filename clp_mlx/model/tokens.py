"""Text to token ids, as mlx-lm does it, and the checks of a prompt (text or ids) for a model."""

from __future__ import annotations

from ..errors import ClpError
from .backbone import context_length, token_count
from .checks import token_ids


def check_text(text, what: str = "the prompt") -> str:
    """``text`` if it is a string that UTF-8 can encode.

    Bytes that are not UTF-8 reach Python as lone surrogates (command-line
    arguments, and standard input in a UTF-8 locale); the tokenizer would
    refuse them with a TypeError from deep inside.
    """
    if not isinstance(text, str):
        raise ClpError(f"{what} must be text, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ClpError(
            f"{what} is not valid UTF-8 text (at character {e.start}): pass UTF-8 text"
        ) from None
    return text


def encode(tokenizer, prompt) -> list:
    """Token ids of ``prompt`` (a string, or already a sequence of ids).

    mlx-lm's rule: special tokens (the BOS) are added unless the prompt
    already starts with the BOS. Ids are returned as given: the decode
    loop checks them against the model (:func:`.checks.token_ids`)."""
    if isinstance(prompt, str):
        check_text(prompt)
        bos = tokenizer.bos_token
        return tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    if isinstance(prompt, (bytes, bytearray)):
        raise ClpError("the prompt is bytes: decode it to text (str) first")
    if hasattr(prompt, "ndim"):  # an MLX or NumPy array: checked as it is
        return prompt
    try:
        return list(prompt)
    except TypeError:
        raise ClpError(
            f"the prompt must be text or a list of token ids, not {type(prompt).__name__}"
        ) from None


def prompt_ids(prompt, model, held: int = 0, context=None) -> tuple[list[int], list[int]]:
    """A prompt's token ids and the ``context`` before it, checked for ``model``.

    Every id must be a whole number the model can embed (0..vocab-1): MLX
    does not check, and an id past the table reads memory beyond it or
    kills the process. The prompt must not be empty, and with the ``held``
    tokens a kept cache already holds it must fit the model's context."""
    vocab = token_count(model)
    ids = token_ids(prompt, vocab)
    if not ids:
        raise ClpError("the prompt is empty: give at least one token")
    limit = context_length(model)
    if limit and held + len(ids) > limit:
        before = f" after the {held} already in the cache" if held else ""
        raise ClpError(
            f"the prompt has {len(ids)} tokens{before}; this model's context holds "
            f"{limit} (max_position_embeddings): shorten the prompt"
        )
    return ids, token_ids(context or [], vocab, "the context")
