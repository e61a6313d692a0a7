"""The Python API, in mlx-lm's shape: load, stream_generate, generate.

model, tokenizer = load("qwen2.5-coder-0.5b-instruct")  # the drafter found rides on the model
text = generate(model, tokenizer, "def fib(n):", max_tokens=64)
text = generate(model, tokenizer, "def fib(n):", sampler=make_sampler(0.7, top_p=0.9))

``load_with_drafter`` returns ``(model, tokenizer, heads)`` and leaves the
choice of heads to the caller (``stream_generate(..., heads)``).
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import replace


from .model import backbone
from .decode.config import DecodeConfig
from .decode.layer_cache import make_prompt_cache as _make_prompt_cache
from .decode.loop import decode
from .decode.steps import DecodeStats, tokens_with_logprobs
from .responses import Response  # noqa: F401  (re-exported: clp_mlx.api.Response)
from .responses import mlx_lm_stream, print_stats, response
from .errors import ClpError
from .model.tokens import encode
from .model.heads import MTPBundle
from .model.heads_files import find_heads, init_heads, load_heads
from .decode.sampling import Sampler, Sampling

DEFAULT_K = 3  # drafts per step for --heads init; trained heads record their own


def load_with_drafter(
    model: str | os.PathLike | None = None,
    heads: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    num_draft_tokens: int | None = None,
    seed: int = 0,
):
    """Load ``(model, tokenizer, heads)``; :func:`load` is mlx-lm's shape.

    ``model``: a named default, an MLX or Hugging Face folder, a GGUF file or
    a Hub repo id (None: the default model). ``heads``: a heads folder,
    ``"init"`` for untrained heads as initialised for training (seeded),
    ``"none"`` for none (verify then drafts from the context alone), or None
    for the first heads made for these weights (:func:`find_heads`: yours in
    ``<cache>/drafters``, then those shipped with clp-mlx), if any. Folders
    may be given as paths (``os.PathLike``).
    """
    from .sources.resolve import resolve_model

    model = _spec(model, "model", "a named model, a folder, a .gguf file or a Hub repo id")
    heads = _spec(heads, "heads", "a heads folder, 'init' or 'none'")
    if dtype is not None and dtype not in backbone.DTYPES:
        raise ClpError(f"unknown dtype {dtype!r}; choose from {sorted(backbone.DTYPES)}")
    path = resolve_model(model, dtype=dtype or backbone.default_dtype())
    net, tokenizer = backbone.load_backbone(path, dtype)
    if heads == "init":
        k = DEFAULT_K if num_draft_tokens is None else num_draft_tokens
        bundle = init_heads(net, k, seed=seed, name=str(model or ""))
    elif heads == "none":
        bundle = None
    elif heads is not None:
        bundle = load_heads(heads, net)
    else:
        found = find_heads(net)
        bundle = load_heads(found, net) if found is not None else None
    return net, tokenizer, bundle


def load(
    path_or_hf_repo: str | os.PathLike | None = None,
    tokenizer_config: dict | None = None,
    model_config: dict | None = None,
    adapter_path: str | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    *,
    drafter: str | os.PathLike | None = None,
    dtype: str | None = None,
):
    """``mlx_lm.load``'s shape: ``(model, tokenizer)`` (``return_config``:
    and the config dict). The drafter (``drafter``, as ``heads`` of
    :func:`load_with_drafter`; None: the one made for these weights, if any)
    rides on the model: :func:`stream_generate` uses it unless given heads.
    ``lazy`` is accepted (weights are read here either way); a tokenizer or
    model config, an adapter or a revision are refused."""
    for value, name in ((tokenizer_config, "tokenizer_config"), (model_config, "model_config"),
                        (adapter_path, "adapter_path"), (revision, "revision")):  # fmt: skip
        if value:
            raise ClpError(f"load(): {name} is not supported by clp-mlx")
    net, tokenizer, heads = load_with_drafter(path_or_hf_repo, drafter, dtype=dtype)
    object.__setattr__(net, "_clp_drafter", heads)  # a plain attribute: no parameter of the model
    if return_config:
        return net, tokenizer, dict(vars(net.args))
    return net, tokenizer


def drafter_of(model) -> MTPBundle | None:
    """The heads :func:`load` found for ``model`` (None: none, or not loaded by it)."""
    return model.__dict__.get("_clp_drafter")


def _spec(value, what: str, means: str) -> str | None:
    """A model or heads argument as a string (None stays None); an empty
    string would mean the working directory, and is refused."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ClpError(f"{what} must be {means}, not {type(value).__name__}")
    text = os.fspath(value)
    if not isinstance(text, str):  # a bytes path
        raise ClpError(f"{what} must be {means}, not a bytes path")
    if not text.strip():
        raise ClpError(f"{what} is empty: give {means} (--{what})")
    return text


def decode_config(
    *,
    mode: str | None = None,
    max_tokens: int = 256,
    num_draft_tokens: int | None = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    feed: str = "cost",
    lookup: bool | None = None,
    clp_threshold: float | None = None,
    tree: int | None = None,
) -> DecodeConfig:
    """A :class:`DecodeConfig` from the keyword arguments of :func:`stream_generate`."""
    return DecodeConfig(
        mode=mode,
        max_tokens=max_tokens,
        draft_len=num_draft_tokens,
        feed=feed,
        context_drafts=lookup,
        tree=tree,
        clp_threshold=clp_threshold,
        sampling=Sampling(temp, top_p, top_k, seed, min_p),
    )


_ATTACHED = object()  # stream_generate's heads: the drafter load() attached, if any


def make_prompt_cache(model, heads: MTPBundle | None = _ATTACHED) -> list:
    """mlx-lm's prompt cache for ``model``, with the MTP layer's keys after
    it (as mlx-lm puts a draft model's cache after the model's): a cache
    kept across calls then lets the layer draft with the earlier turns too.
    ``heads``: default, the drafter :func:`load` attached."""
    return _make_prompt_cache(model, drafter_of(model) if heads is _ATTACHED else heads)


def stream_generate(
    model,
    tokenizer,
    prompt,
    heads: MTPBundle | None = _ATTACHED,
    *,
    sampler=None,
    logits_processors=None,
    prompt_cache=None,
    draft_model=None,
    config: DecodeConfig | None = None,
    context=None,
    **options,
):
    """Yield a :class:`Response` per token; the last one has a finish reason.

    How to decode is ``config``, or the keyword arguments of
    :func:`decode_config` (``mode``, ``max_tokens``, ``temp``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``, ``num_draft_tokens``, ``feed``, ``lookup``,
    ``clp_threshold``, ``tree``); see :class:`clp_mlx.decode.config.DecodeConfig`
    for what each means. ``temp`` 0 is greedy; ``verify`` samples exactly from
    the backbone's distribution. ``sampler``: one from
    :func:`clp_mlx.sample_utils.make_sampler` (mlx-lm's arguments) keeps
    verify; mlx-lm's own samplers, ``logits_processors`` and ``draft_model``
    run mlx-lm's generation instead, whose distribution clp-mlx cannot check.
    ``heads``: default, the drafter :func:`load` attached. ``prompt_cache`` is
    extended in place: see :func:`clp_mlx.decode.loop.decode` for what it
    holds after. ``context``: the tokens ``prompt_cache`` already holds
    (earlier turns), for context drafts to copy from.
    """
    if heads is _ATTACHED:
        heads = drafter_of(model)
    if config is not None and options:
        raise ClpError(f"pass either config or options, not both ({', '.join(options)})")
    foreign = sampler is not None and not isinstance(sampler, Sampler)
    if foreign or logits_processors or draft_model is not None:
        yield from mlx_lm_stream(
            model, tokenizer, prompt, options, sampler=sampler, prompt_cache=prompt_cache,
            logits_processors=logits_processors, draft_model=draft_model,
        )  # fmt: skip
        return
    unknown = sorted(set(options) - set(inspect.signature(decode_config).parameters))
    if unknown:
        raise ClpError(f"unknown option {', '.join(unknown)}; see clp_mlx.api.decode_config")
    config = config or decode_config(**options)
    if sampler is not None:
        config = replace(config, sampling=sampler.settings)
    config = config.resolve(model, heads)
    tokens = encode(tokenizer, prompt)
    stats = DecodeStats(config.mode, config.draft_len or 0)
    detok = tokenizer.detokenizer
    detok.reset()
    steps = decode(tokens, model, heads, config, prompt_cache=prompt_cache, context=context)
    pairs = tokens_with_logprobs(stats.counting(steps))
    max_tokens = config.max_tokens
    tic = time.perf_counter()
    prompt_tps = 0.0
    n = 0
    token, from_draft, logprobs, reason = None, False, None, "length"
    try:
        for n, (token, from_draft, logprobs) in enumerate(pairs, start=1):
            if n == 1:
                prompt_time = time.perf_counter() - tic
                prompt_tps = len(tokens) / prompt_time
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                reason = "stop"
                break
            detok.add_token(token)
            if n == max_tokens:
                break
            yield response(
                detok.last_segment, token, from_draft, len(tokens), prompt_tps, n, tic, None, stats,
                logprobs,
            )
    finally:
        # Also when the caller stops early: the decode generator leaves its
        # stream context now, not whenever it is garbage-collected.
        pairs.close()
    detok.finalize()
    yield response(
        detok.last_segment, token, from_draft, len(tokens), prompt_tps, n, tic, reason, stats,
        logprobs,
    )


def generate(
    model, tokenizer, prompt, heads: MTPBundle | None = _ATTACHED, *, verbose=False, **kwargs
) -> str:
    """Generate a complete response; with ``verbose``, stream it and print
    statistics, as mlx-lm does. Arguments: :func:`stream_generate`'s."""
    if verbose:
        print("=" * 10)
    text = ""
    last = None
    for last in stream_generate(model, tokenizer, prompt, heads, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print_stats(last)
    return text
