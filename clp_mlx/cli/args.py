"""What every command-line entry point shares: how errors reach the user, and the
flags for a model and for decoding (one :class:`DecodeConfig` per command)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import Callable, Sequence

from ..decode.config import FEEDS, MODES, DecodeConfig
from ..decode.sampling import Sampling
from ..errors import ClpError
from ..model.backbone import DTYPES
from .mlx_lm_flags import add_trust_remote_code

DEBUG = "--debug"
# MLX's messages for a file it cannot read start with the failing function:
# "[load_safetensors] ...", "[read] ...", "[safetensor] unsupported dtype ...".
_MLX_FILE_ERROR = re.compile(r"^\[(load|read|safetensor|gguf|save)\w*\]")


def parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """A command's argument parser, with the ``--debug`` flag every command takes."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_debug(p)
    return p


def add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument(DEBUG, action="store_true",
                   help="show the traceback of an error (for bug reports)")  # fmt: skip


def guarded(main: Callable[[], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main``: a user error prints one line ``error: ...`` and gives 1,
    Ctrl-C gives 130. With ``--debug`` in ``argv`` (default: the command
    line) an error keeps its traceback. Anything not foreseen here is a bug:
    it keeps its traceback too."""
    debug = DEBUG in (sys.argv[1:] if argv is None else argv)
    try:
        return main() or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = user_error(e)
        if line is None or debug:
            raise
        if isinstance(e, BrokenPipeError):  # nothing more can reach a closed stdout
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"error: {line}", file=sys.stderr)
        return 1


def user_error(e: BaseException) -> str | None:
    """The one line for an error a user can fix (bad input, a file that cannot
    be read or written), or None for a bug."""
    if isinstance(e, ClpError):
        return str(e)
    if isinstance(e, UnicodeError):
        return f"text that is not valid UTF-8 ({e}): pass UTF-8 text"
    if isinstance(e, OSError):
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        what = e.strerror or str(e) or type(e).__name__
        return f"{what}: {where}" if where else what
    if isinstance(e, (RuntimeError, ValueError)) and _MLX_FILE_ERROR.match(str(e)):
        return f"cannot read a file: {str(e).splitlines()[0]}"
    return None


def run(main: Callable[[], int | None]) -> None:
    """Run a command's ``main`` and exit with its status (see :func:`guarded`)."""
    _fill_standard_fds()
    sys.exit(guarded(main))


def _fill_standard_fds() -> None:
    """Put /dev/null where the caller closed stdin, stdout or stderr: else
    the next file opened takes that number, and MLX, which reads descriptor
    0 as a failed open, would call a good weights file unreadable."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one


def add_model_output_args(
    parser: argparse.ArgumentParser,
    dtypes: Sequence[str],
    q_bits: Sequence[int],
    group_sizes: Sequence[int],
) -> None:
    """-o/--out, --dtype, -q/--q-bits, --q-group-size, --force: what model converters share."""
    parser.add_argument(
        "-o", "--out", required=True, help="output folder (must not exist unless --force)"
    )
    parser.add_argument(
        "--dtype",
        choices=list(dtypes),
        default="float16",
        help="dtype of the written weights (default: float16)",
    )
    parser.add_argument(
        "-q",
        "--q-bits",
        type=int,
        choices=q_bits,
        default=None,
        help="quantize with MLX to this many bits",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        choices=group_sizes,
        default=64,
        help="MLX quantization group size (default: 64)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the output folder if it exists"
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --drafter (--heads), --dtype, --trust-remote-code: what every
    command that loads a model takes."""
    p.add_argument(
        "--model",
        default=None,
        help="named model, MLX/HF folder, .gguf file or Hub repo (default: qwen2.5-coder-0.5b-instruct)",
    )
    p.add_argument(
        "--drafter",
        "--heads",
        dest="heads",
        default=None,
        metavar="HEADS",
        help="clp-mlx's drafter: a heads folder, 'init' for untrained heads, or 'none': "
        "context drafts only (default: heads made for these weights, found in the cache's "
        "drafters folder or shipped with clp-mlx)",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None,
        help="cast float weights to this dtype (default: the folder's own, as mlx-lm; "
        "float weights become float32 on the CPU backend, where only float32 uses BLAS)",
    )
    add_trust_remote_code(p)


def add_decode_args(p: argparse.ArgumentParser, *, max_tokens: int, seed: int | None) -> None:
    """The options of :class:`DecodeConfig`, as flags (shared by generate and chat).
    ``seed``: --seed's default (mlx-lm's: None in generate, 0 in chat)."""
    p.add_argument("--max-tokens", "-m", type=int, default=max_tokens,
                   help=f"most tokens to generate (default: {max_tokens})")  # fmt: skip
    p.add_argument("--mode", choices=MODES, default=None, help="default: verify (without heads: on context drafts)")
    p.add_argument(
        "--draft-len", type=int, default=None, metavar="N",
        help="drafts per step of clp-mlx's drafter (default: all the heads' k; without heads, "
        "or copies beside an MTP layer in greedy verify, up to 6 copied tokens)",
    )  # fmt: skip
    p.add_argument(
        "--verify-feed",
        choices=FEEDS,
        default="cost",
        help="verify: feed the count of drafts with the most expected tokens per pass time "
        "(cost, default; pass times measured once per setup), as many as CLP expects to be "
        "accepted (clp), or every draft (all)",
    )
    p.add_argument(
        "--context-drafts",
        choices=("auto", "on", "off"),
        default="auto",
        help="copy drafts from the context where it has a match (auto: in verify, not in clp)",
    )
    p.add_argument(
        "--clp-threshold",
        type=float,
        default=None,
        help="clp: accept the longest n whose P(run >= n) reaches this (default: CLP's most "
        "likely run, the paper's rule)",
    )
    p.add_argument(
        "--tree",
        type=int,
        default=None,
        help="verify: a step that feeds 2+ drafts feeds a token tree of up to this many "
        "tokens, alternatives included; 0: a chain (default: 16 where wide passes are "
        "padded; else a chain, with the drafter's runners-up as leaves where the pass "
        "costs say they pay)",
    )
    add_sampling_args(p, seed)


def add_sampling_args(p: argparse.ArgumentParser, seed: int | None) -> None:
    p.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: 0). verify mode samples exactly "
        "from the backbone's distribution",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument(
        "--min-p", type=float, default=0.0,
        help="drop tokens less likely than this times the likeliest (default: 0, off)",
    )  # fmt: skip
    p.add_argument(
        "--min-tokens-to-keep", type=int, default=1, metavar="N",
        help="mlx-lm's floor for min-p; only 1 is supported (min-p keeps the likeliest token)",
    )  # fmt: skip
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens (default: 0, all)"
    )
    fresh = "none, a fresh random draw each run; --drafter init then takes 0" if seed is None else seed
    p.add_argument("--seed", type=int, default=seed,
                   help=f"PRNG seed, for sampling and --drafter init (default, as mlx-lm: {fresh})")  # fmt: skip


def draft_len(args: argparse.Namespace) -> int | None:
    """Drafts per step for clp-mlx's drafter: --draft-len, or --num-draft-tokens
    where no --draft-model takes it (its meaning before --draft-len; in mlx-lm,
    also "tokens to draft")."""
    mine = args.draft_len
    theirs = getattr(args, "num_draft_tokens", None)
    if getattr(args, "draft_model", None) is not None:
        return mine
    if mine is not None and theirs is not None:
        raise ClpError("pass --draft-len or --num-draft-tokens, not both (without --draft-model they mean the same)")
    return theirs if mine is None else mine


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    """The :class:`DecodeConfig` the flags ask for; bad values fail here, before a model loads."""
    if args.min_tokens_to_keep != 1:
        raise ClpError(
            "--min-tokens-to-keep is not supported by clp-mlx: min-p keeps the likeliest "
            f"token only (1, the default), got {args.min_tokens_to_keep}"
        )
    return DecodeConfig(
        mode=args.mode,
        max_tokens=args.max_tokens,
        draft_len=draft_len(args),
        feed=args.verify_feed,
        context_drafts={"auto": None, "on": True, "off": False}[args.context_drafts],
        tree=args.tree,
        clp_threshold=args.clp_threshold,
        sampling=Sampling(args.temp, args.top_p, args.top_k, args.seed, args.min_p),
    )


def load_model(args: argparse.Namespace, config: DecodeConfig):
    """(model, tokenizer, heads, ``config`` resolved for them) as --model,
    --drafter, --dtype, --draft-len and --seed ask (--drafter init: seed 0
    when none is given)."""
    from ..api import load_with_drafter as load

    seed = 0 if args.seed is None else args.seed
    model, tokenizer, heads = load(
        args.model, args.heads, dtype=args.dtype, num_draft_tokens=config.draft_len, seed=seed
    )
    return model, tokenizer, heads, config.resolve(model, heads)


def no_drafter_note(args: argparse.Namespace, heads, config: DecodeConfig) -> str | None:
    """What a command says, once (once its input has passed), when it looked
    for heads for a mode that drafts and found none; None otherwise."""
    from ..paths import cache_root

    if heads is not None or args.heads is not None or config.mode == "ar":
        return None
    spec = f" --model {shlex.quote(args.model)}" if args.model else ""
    out = shlex.quote(str(cache_root() / "drafters" / "NAME"))
    return (
        "note: no matching drafter for this model; drafting from the context only. "
        f"Train one: python -m clp_mlx.train{spec} --data TEXT_FILES --out {out}"
    )
