"""Text to token ids, as mlx-lm does it."""

from __future__ import annotations


def encode(tokenizer, prompt) -> list:
    """Token ids of ``prompt`` (a string, or already a list of ids).

    mlx-lm's rule: special tokens (the BOS) are added unless the prompt
    already starts with the BOS."""
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    return list(prompt)
