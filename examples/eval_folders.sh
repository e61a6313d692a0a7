#!/usr/bin/env bash
# The held-out evaluation folders of docs/RESULTS.md's drafter tables, resumably:
# each model's continuations of 128 WikiText-2 valid openings (40 new tokens) and its
# answers to 128 questions the 0.5B wrote with seed 100 (96 new tokens), every row
# held out, with the backbone's earlier layers' states the shipped layers read.
# Run it again after a kill: whole shards are kept and only the rest is made.
#
#   examples/eval_folders.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]
#
# Then score a drafter on them (drafter alone, and with context copies):
#   python -m clp_mlx.train --eval --by-confidence --model qwen2.5-coder-1.5b-instruct \
#       --heads DRAFTER --data OUT_ROOT/15b/eval-wikivalid-side OUT_ROOT/15b/eval-magpie-s100-side
set -euo pipefail
usage="usage: eval_folders.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]"
wiki=${1:?$usage}
root=${2:?$usage}
which=${3:-all}
case $which in 05b|15b|all) ;; *) echo "eval_folders.sh: which models: 05b, 15b or all, not '$which'" >&2; exit 2;; esac
[ -f "$wiki/wiki.valid.raw" ] || { echo "eval_folders.sh: no wiki.valid.raw in $wiki" >&2; exit 2; }
common=(--heldout 1 --batch 128 --shard-size 128 --prompts 128)
questions=$root/05b/eval-magpie-s100q

run() {  # run MODEL OUT [args...]
    local model=$1 out=$2; shift 2
    echo "$(date -u +%FT%TZ) $out"
    python -m clp_mlx.cli.distill --model "$model" --out "$out" "${common[@]}" "$@"
}

folders() {  # folders MODEL SUBDIR SIDE_LAYERS...
    local model=$1 dir=$root/$2; shift 2
    run "$model" "$dir/eval-wikivalid-side" --kind wikitext --data "$wiki/wiki.valid.raw" \
        --prompt-tokens 32 --new-tokens 40 --side-layers "$@"
    run "$model" "$dir/eval-magpie-s100-side" --kind magpie --data "$questions" \
        --prompt-tokens 48 --new-tokens 96 --side-layers "$@"
}

# The questions, written once by the 0.5B; both models answer the same ones.
run qwen2.5-coder-0.5b-instruct "$questions" --kind magpie --prompt-tokens 48 --new-tokens 1 --seed 100
case $which in 15b|all) folders qwen2.5-coder-1.5b-instruct 15b 2 14;; esac
case $which in 05b|all) folders qwen2.5-coder-0.5b-instruct 05b 2 12;; esac
echo "$(date -u +%FT%TZ) done"
