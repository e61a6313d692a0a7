#!/usr/bin/env bash
# The self-distilled data of docs/DATA.md, every folder in order, resumably.
# Run it again after a kill (or in a later session): whole shards are kept and
# only the rest is made. Each folder's settings are fixed once it exists.
#
#   examples/distill_all.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]
#
# WIKITEXT_DIR holds wiki.train.raw and wiki.valid.raw; OUT_ROOT gets 05b/ and 15b/.
set -euo pipefail
wiki=${1:?usage: distill_all.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]}
root=${2:?usage: distill_all.sh WIKITEXT_DIR OUT_ROOT [05b|15b|all]}
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

if [ "$which" = 05b ] || [ "$which" = all ]; then
    m=qwen2.5-coder-0.5b-instruct
    run $m 05b/wikitext 96 3500 wikitext --data "$wiki/wiki.train.raw" --prompt-tokens 32
    run $m 05b/wikitext-valid 96 256 wikitext --data "$wiki/wiki.valid.raw" --prompt-tokens 32 --heldout 1
    run $m 05b/code 96 3500 code --data "$stdlib" --prompt-tokens 32
    run $m 05b/magpie 96 3500 magpie --prompt-tokens 48
fi
if [ "$which" = 15b ] || [ "$which" = all ]; then
    m=qwen2.5-coder-1.5b-instruct
    run $m 15b/wikitext 40 3400 wikitext --data "$wiki/wiki.train.raw" --prompt-tokens 32
    run $m 15b/wikitext-valid 40 256 wikitext --data "$wiki/wiki.valid.raw" --prompt-tokens 32 --heldout 1
    run $m 15b/code 40 3400 code --data "$stdlib" --prompt-tokens 32
    run $m 15b/magpie 40 3400 magpie --prompt-tokens 32
fi
echo "$(date -u +%FT%TZ) done"
