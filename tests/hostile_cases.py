"""The hostile cases of tests/test_hostile.py, one builder per group.

Each builder gets the :class:`hostile_inputs.Batch` and the shared, valid
inputs (:class:`Inputs`) and adds cases; every case copies (hard-links) what
it needs into its own ``in/`` and replaces, never edits, a file it corrupts, so
no case can harm another's inputs. Classes: 1 process death from data, 2 data
loss, 3 tracebacks for user errors, 4 leftovers of killed runs, 5 silent
acceptance, 7 trust (code named by a file).

The builders live by topic: ``hostile_cases_heads`` (heads files, prompt ids,
Medusa checkpoints, packaging), ``hostile_cases_models`` (model folders, Hugging
Face folders, GGUF files), ``hostile_cases_commands`` (command-line flags),
``hostile_cases_keep`` (classes 2, 4, 5); what they share, ``hostile_cases_base``.
"""

from __future__ import annotations

from hostile_cases_base import Inputs, link, make_inputs
from hostile_cases_commands import bench_cmds, decode_flags, distill_cmd, train_cmd, train_mtp_cmd
from hostile_cases_heads import heads_files, heads_to_package, prompt_ids, torch_heads
from hostile_cases_keep import converters_keep_data, leftovers, silent
from hostile_cases_models import gguf_files, hf_configs, model_folders

__all__ = ["GROUPS", "Inputs", "link", "make_inputs"]

GROUPS = {
    "heads_files": heads_files,
    "prompt_ids": prompt_ids,
    "converters_keep_data": converters_keep_data,
    "model_folders": model_folders,
    "hf_configs": hf_configs,
    "gguf_files": gguf_files,
    "torch_heads": torch_heads,
    "heads_to_package": heads_to_package,
    "train": train_cmd,
    "bench": bench_cmds,
    "distill": distill_cmd,
    "train_mtp": train_mtp_cmd,
    "decode_flags": decode_flags,
    "leftovers": leftovers,
    "silent": silent,
}
