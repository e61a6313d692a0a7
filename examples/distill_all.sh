#!/usr/bin/env bash
# The self-distilled data of docs/DATA.md, every folder in order, resumably.
# Run it again after a kill (or in a later session): whole shards are kept and
# only the rest is made. Each folder's settings are fixed once it exists.
#
#   examples/distill_all.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]
#
# WIKITEXT_DIR holds wiki.train.raw and wiki.valid.raw; OUT_ROOT gets 05b/ and 15b/.
set -euo pipefail
usage="usage: distill_all.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]"
wiki=${1:?$usage}
root=${2:?$usage}
which=${3:-all}
case $which in 05b|15b|all) ;; *) echo "distill_all.sh: which models: 05b, 15b or all, not '$which'" >&2; exit 2;; esac
stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
common=(--batch 128 --shard-size 128 --quiet)

run() {  # run MODEL SUBDIR NEW_TOKENS PROMPTS KIND [args...]
    local model=$1 out=$root/$2 new=$3 prompts=$4 kind=$5; shift 5
    echo "$(date -u +%FT%TZ) $out"
    python -m clp_mlx.cli.distill --model "$model" --out "$out" --kind "$kind" \
        --prompts "$prompts" --new-tokens "$new" "${common[@]}" "$@"
}

plan() {  # plan MODEL SUBDIR NEW_TOKENS PROMPTS MAGPIE_PROMPT_TOKENS
    local model=$1 dir=$2 new=$3 prompts=$4
    run $model $dir/wikitext $new $prompts wikitext --data "$wiki/wiki.train.raw" --prompt-tokens 32
    run $model $dir/wikitext-valid $new 256 wikitext --data "$wiki/wiki.valid.raw" \
        --prompt-tokens 32 --heldout 1
    # magpie before code: its chat-template answers are what chat prompts decode
    run $model $dir/magpie $new $prompts magpie --prompt-tokens $5
    run $model $dir/code $new $prompts code --data "$stdlib" --prompt-tokens 32
}

case $which in 05b|all) plan qwen2.5-coder-0.5b-instruct 05b 96 3500 48;; esac
case $which in 15b|all) plan qwen2.5-coder-1.5b-instruct 15b 40 3400 32;; esac
echo "$(date -u +%FT%TZ) done"
