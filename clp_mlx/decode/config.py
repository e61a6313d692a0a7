"""Every decode option in one place: :class:`DecodeConfig`, its defaults and checks.

The API, each command and the benchmark build one ``DecodeConfig``;
``__post_init__`` checks what needs no model (so a command fails before it
loads one), and :meth:`DecodeConfig.resolve` fills the defaults that depend on
the model and its heads and checks the rest. Nothing else in the package
decides a decode default.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import ClpError
from ..model.checks import is_whole, real, whole
from ..model.heads import MTPBundle
from ..native import padrows
from .sampling import Sampling

MODES = ("ar", "clp", "fixed", "gate", "prior-mtp", "verify")
CONTEXT_K = 6  # drafts per step, at most, from the context alone (no heads)
MAX_CONTEXT_K = 15  # a pass feeds at most 16 tokens
FEEDS = ("all", "clp", "cost")  # how many drafts greedy verify feeds; see feed.py


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode. ``None`` fields are filled by :meth:`resolve`."""

    # ar, the paper's clp / fixed / gate / prior-mtp, or lossless verify.
    # None: verify (with no heads, it drafts from the context alone).
    mode: str | None = None
    max_tokens: int = 256
    # Drafts per step, 1..k. None: all k the heads draft (the paper's horizon);
    # with no heads, up to CONTEXT_K copied tokens; in greedy verify with the
    # MTP layer and copies, the layer drafts up to k and copies up to this
    # (None: CONTEXT_K, at most MAX_CONTEXT_K).
    # Given with mode ar (which drafts nothing) it is refused, never ignored.
    draft_len: int | None = None
    # Greedy verify: feed the draft count with the most expected tokens per
    # unit of pass time ("cost"), as many as CLP expects to pass ("clp"), or
    # every draft ("all"). The output is the same; only the speed differs.
    feed: str = "cost"
    # Copy drafts from the context where it repeats. None: on in verify, off
    # in clp, where one unchecked wrong copy can send the backbone into a
    # loop. With heads, only heads fitted for it (and clp only greedy).
    context_drafts: bool | None = None
    # Greedy verify: a step feeding 2+ drafts feeds a token tree of up to
    # this many tokens; 0 feeds a chain. None: the padded width where wide
    # passes are padded anyway (the extra rows cost nothing); elsewhere a
    # chain, with the drafter's runners-up as leaves where the pass costs say
    # they pay (feed "cost"; the MTP layer's: feed.best_tree).
    tree: int | None = None
    # clp / prior-mtp: accept the longest run n with P(run >= n) >= this;
    # None is the paper's rule, CLP's most likely run.
    clp_threshold: float | None = None
    gate_threshold: float = 0.5  # gate baseline: accept while sigmoid > this
    sampling: Sampling = field(default_factory=Sampling)

    def __post_init__(self):
        if self.mode is not None and self.mode not in MODES:
            raise ClpError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        whole(self.max_tokens, "max_tokens (--max-tokens)", 1)
        if self.draft_len is not None:
            whole(self.draft_len, "draft_len (--draft-len)", 1)
        if self.feed not in FEEDS:
            raise ClpError(
                f"feed must be one of {', '.join(FEEDS)}, got {self.feed!r} (--verify-feed)"
            )
        if self.context_drafts is not None and not isinstance(self.context_drafts, bool):
            raise ClpError(
                f"context_drafts must be None, True or False, got {self.context_drafts!r}"
            )
        if self.clp_threshold is not None:
            q = real(self.clp_threshold, "clp_threshold (--clp-threshold)")
            if not 0 < q <= 1:
                raise ClpError(f"clp_threshold must be in (0, 1], got {q} (--clp-threshold)")
        if self.tree is not None and not (is_whole(self.tree) and self.tree >= 0):
            raise ClpError(
                f"tree must be 0 (a chain) or a number of tokens, got {self.tree!r} (--tree)"
            )
        if not 0 <= real(self.gate_threshold, "gate_threshold") <= 1:
            raise ClpError(f"gate_threshold must be in [0, 1], got {self.gate_threshold}")
        if not isinstance(self.sampling, Sampling):
            raise ClpError(f"sampling must be a Sampling, got {type(self.sampling).__name__}")

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def resolve(self, model, heads) -> "DecodeConfig":
        """A copy with every default filled for ``model`` and its ``heads``
        (None for none), or ClpError saying what does not fit."""
        if heads is not None and not isinstance(heads, MTPBundle):
            raise ClpError(
                f"heads must be what clp_mlx.load gives (or None), not {type(heads).__name__}"
            )
        mode = self.mode or "verify"
        if mode == "ar" and self.draft_len is not None:
            raise ClpError(
                "--draft-len (draft_len) drafts nothing in mode ar: drop it, or pick a "
                f"mode that drafts ({', '.join(m for m in MODES if m != 'ar')})"
            )
        if mode == "ar":
            return replace(self, mode=mode, context_drafts=False, tree=0)
        tree = self.tree
        if tree is None and padrows.is_padded(model):
            tree = padrows.ROWS
        if not (self.greedy and mode == "verify"):
            tree = 0
        if heads is None:
            return self._copies_only(mode, tree)
        part = {"gate": "gate", "prior-mtp": "head0"}.get(mode)
        if part and part not in heads:
            raise ClpError(f"these heads have no {part} for mode {mode!r}")
        wanted = self.context_drafts if self.context_drafts is not None else mode == "verify"
        fits = bool(heads.config.lookup) and (mode == "verify" or (mode == "clp" and self.greedy))
        context = fits and wanted
        # Greedy verify copies past the MTP layer's depths: a copy runs as far
        # as the context repeats, and the feed rule stops where it stops paying.
        longer = context and mode == "verify" and self.greedy and heads.config.design == "mtp"
        most = MAX_CONTEXT_K if longer else heads.k
        n = self.draft_len or (max(heads.k, CONTEXT_K) if longer else heads.k)
        if not 1 <= n <= most:
            raise ClpError(f"draft_len must be in 1..{most} for these heads, got {n} (--draft-len)")
        return replace(self, mode=mode, draft_len=n, context_drafts=context, tree=tree)

    def _copies_only(self, mode: str, tree: int) -> "DecodeConfig":
        """Resolved for no heads: verify with context drafts alone."""
        if mode != "verify":
            raise ClpError(
                f"mode {mode!r} needs heads (pass --heads, or --heads init); "
                "verify runs without them, on context drafts"
            )
        if self.context_drafts is False:
            raise ClpError(
                "with no heads verify drafts only from the context: turn context drafts "
                "on (--context-drafts), pass --heads, or use --mode ar"
            )
        n = CONTEXT_K if self.draft_len is None else self.draft_len
        if not 1 <= n <= MAX_CONTEXT_K:
            raise ClpError(
                f"draft_len must be in 1..{MAX_CONTEXT_K} for context drafts, got {n} (--draft-len)"
            )
        return replace(self, mode=mode, draft_len=n, context_drafts=True, tree=tree)
