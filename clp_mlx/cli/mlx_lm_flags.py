"""mlx-lm's flags in clp-mlx's commands: the ones clp-mlx takes with mlx-lm's
meaning (``--verbose BOOL``, ``--max-kv-size``, ``--prefill-step-size``,
``--trust-remote-code``), and the ones it refuses, each with one line
``error: --FLAG is not supported by clp-mlx: <why>``.

A refused flag given mlx-lm's default value is accepted: that value asks for
what clp-mlx does anyway (``--kv-group-size 64`` without ``--kv-bits``), so
scripts that spell every flag out keep working. See docs/FLAGS.md.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field

from ..errors import ClpError
from ..model.backbone import context_length

PREFILL_STEP = 2048  # mlx-lm's default --prefill-step-size, and clp-mlx's chunk


@dataclass(frozen=True)
class Refused:
    """An mlx-lm flag clp-mlx refuses: its option strings, argparse shape,
    mlx-lm's default (accepted) and why any other value is refused."""

    flags: tuple[str, ...]
    why: str
    default: object = None
    shape: dict = field(default_factory=dict)  # type / nargs / action, as mlx-lm's
    commands: tuple[str, ...] = ("generate", "chat")


REFUSED = (
    Refused(("--adapter-path",), "LoRA adapters are not applied; fuse them into the model "
            "(mlx_lm.fuse) and pass the fused folder as --model"),
    Refused(("--image",), "Qwen2.5 takes text only", (), {"nargs": "+"}, ("generate",)),
    Refused(("--prompt-cache-file",), "mlx-lm's saved KV caches are not read; the prompt is "
            "prefilled on each run", commands=("generate",)),
    Refused(("--quantize-activations", "-qa"), "activations are not quantized",
            False, {"action": "store_true"}, ("generate",)),
    Refused(("--kv-bits",), "the KV cache is not quantized (verify trims and rewrites it "
            "every step)", None, {"type": int}, ("generate",)),
    Refused(("--kv-group-size",), "the KV cache is not quantized (see --kv-bits)", 64,
            {"type": int}, ("generate",)),
    Refused(("--quantized-kv-start",), "the KV cache is not quantized (see --kv-bits)", 5000,
            {"type": int}, ("generate",)),
    Refused(("--xtc-probability",), "XTC sampling is not implemented", 0.0, {"type": float}),
    Refused(("--xtc-threshold",), "XTC sampling is not implemented (see --xtc-probability)",
            0.1, {"type": float}),
    Refused(("--pipeline",), "distributed inference is not implemented: clp-mlx runs on one "
            "device", False, {"action": "store_true"}, ("chat",)),
)  # fmt: skip


def add_refused(p: argparse.ArgumentParser, command: str) -> None:
    """mlx-lm's flags that ``command`` refuses, in a help group of their own."""
    group = p.add_argument_group(
        "mlx-lm flags clp-mlx does not support",
        "accepted only at mlx-lm's default value, which asks for nothing clp-mlx does not do",
    )
    for r in REFUSED:
        if command in r.commands:
            shape = {"default": None, **r.shape}
            if shape.get("action") == "store_true":
                shape["default"] = False
            group.add_argument(*r.flags, help=r.why, **shape)


def refuse_unsupported(args: argparse.Namespace) -> None:
    """ClpError naming the first refused flag given a value other than mlx-lm's default."""
    for r in REFUSED:
        dest = r.flags[0].lstrip("-").replace("-", "_")
        value = getattr(args, dest, None)
        if value is None or value == r.default or (isinstance(value, (list, tuple)) and not value):
            continue
        raise ClpError(f"{r.flags[0]} is not supported by clp-mlx: {r.why}")


def str2bool(text: str) -> bool:
    """mlx-lm's --verbose values: 'False'/'F' are False, 'True'/'T' True
    (any case). mlx-lm reads every other word as True, even '0' or 'no';
    clp-mlx refuses those rather than guess."""
    word = text.strip().lower()
    if word in ("false", "f"):
        return False
    if word in ("true", "t", "1", "yes", "y"):
        return True
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        type=str2bool,
        nargs="?",
        const=True,
        default=True,
        metavar="BOOL",
        help="True (default; alone: True): the text between '==========' lines, then the "
        "statistics; False: only the text (as mlx-lm)",
    )


def add_trust_remote_code(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for mlx-lm's scripts; does nothing: Qwen2.5's tokenizer runs no "
        "remote code",
    )


def add_max_kv_size(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        metavar="N",
        help=f"most tokens the KV cache may hold (default: the model's context length). "
        f"Unlike mlx-lm's rotating cache, no token is ever dropped: {what}",
    )


def check_max_kv_size(n: int | None) -> None:
    """What --max-kv-size needs before a model loads: room for a prompt token and an answer."""
    if n is not None and n < 2:
        raise ClpError(f"--max-kv-size must be at least 2, got {n}")


def kv_limit(n: int | None, model) -> int | None:
    """The most tokens the cache may hold for ``model``: --max-kv-size, at most
    the model's context (which is the default)."""
    check_max_kv_size(n)
    context = context_length(model)
    if n and context and n > context:
        raise ClpError(f"--max-kv-size {n} is more than this model's context ({context})")
    return n or context


def add_prefill_step_size(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=PREFILL_STEP,
        metavar="N",
        help="prompt tokens fed per pass while prefilling; fewer lower the peak memory "
        f"(default: {PREFILL_STEP}, as mlx-lm)",
    )


def check_prefill_step_size(n: int) -> None:
    if n < 1:
        raise ClpError(f"--prefill-step-size must be at least 1, got {n}")


@contextlib.contextmanager
def prefill_step_size(n: int):
    """Prefill in chunks of ``n`` tokens while the block runs (the decode loop's chunk)."""
    from ..decode import loop

    check_prefill_step_size(n)
    old, loop.PREFILL_STEP = loop.PREFILL_STEP, n
    try:
        yield
    finally:
        loop.PREFILL_STEP = old
