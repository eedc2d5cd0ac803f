#!/usr/bin/env bash
# `make train-draft`: trains an EAGLE-3 head for a model with data the model
# makes itself, in five stages, each showing its progress:
#
#   1. prompts   aerie gen-prompts, in parts of $PART: user turns the model
#                writes after openings of many tasks and topics
#                (tools/make_seeds.py, tools/prompts/), none containing a
#                prompt of the held-out set tools/prompts/heldout.jsonl
#   2. features  aerie dump-features: the model answers each prompt (greedy);
#                the captured features and top-8 next-token probabilities
#                go to safetensors shards. It runs beside stage 3 and pauses
#                while $PENDING shards wait for the trainer.
#   3. train     tools/train_eagle3.py train --stream (PyTorch, CPU): one
#                pass over the shards as they are written, each replaced by
#                an empty marker once trained on, so the disk holds a few
#                shards however much data there is
#   4. export    the head in the published EAGLE-3 layout, copied to HEAD
#   5. evaluate  aerie eval-draft on the held-out prompts: acceptance for a
#                chain of 1, a chain of 3 and the default tree
#
# Every stage resumes: each part of the prompts is kept once written,
# dump-features goes on after its last shard, the trainer from its last
# checkpoint (within a shard). So an interrupted run (Ctrl-C, a reboot) is
# continued by running it again with the same settings.
#
# A run that outlives its machine (the work files are lost) goes on from
# the head it last exported: INIT=that head and FIRST_PART=the first part
# it has not seen train it further on new prompts, with its draft
# vocabulary and a fresh learning-rate schedule. The head's training.json
# records what it started from ("init"), so the chain of runs is on file.
# Settings come from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
WORK=${WORK:-build/train/smollm2-stream}
HEAD=${HEAD:-models/smollm2-135m-eagle3}
HELDOUT=${HELDOUT:-tools/prompts/heldout.jsonl}   # never trained on
PROMPTS=${PROMPTS:-40000}         # training prompts
PART=${PART:-2000}                # prompts per gen-prompts run (the unit of resuming stage 1)
MAX_NEW=${MAX_NEW:-256}           # longest response
BATCH=${BATCH:-32}                # sequences generated together
SHARD=${SHARD:-64}                # sequences per feature shard
PENDING=${PENDING:-8}             # shards on disk waiting for the trainer, at most
VOCAB_SHARDS=${VOCAB_SHARDS:-8}   # first shards whose responses choose the draft vocabulary (<= PENDING)
TTT=${TTT:-6}                     # unrolled draft steps in training
DRAFT_VOCAB=${DRAFT_VOCAB:-4096}  # the shipped head's; tools/train_eagle3.py vocab measures 2k..16k on a dump
EVAL_TOKENS=${EVAL_TOKENS:-128}   # longest answer in the evaluation; answers end where the model ends them
EVAL_SHAPES=${EVAL_SHAPES:-5/4/8,1/1/2,3/1/4}
INIT=${INIT:-}                    # a head to train further instead of starting from random weights
FIRST_PART=${FIRST_PART:-0}       # first prompt part: a run from INIT takes parts its head has not seen
PYTHON=${PYTHON:-python3}
AERIE=${AERIE:-build/aerie}

say() { printf '\ntrain-draft: %s\n' "$*"; }
hours() { awk -v s="$1" 'BEGIN { printf "%.1f h", s / 3600 }'; }

# Expected times: an extrapolation, not a measurement of these settings.
# The rates were measured on the 2-core AMD EPYC (Zen 4) machine when the
# shipped head was made (2 threads, unloaded; its README): gen-prompts
# 12.7 sampled turns/s (1.25 samples per kept turn), dump-features 1.97
# prompts/s at 256 new tokens (264 tokens a sequence), training 1225
# tokens/s at ttt 3. A training step at ttt 6 costs 2.13x one at ttt 3
# (measured side by side: each unrolled step 0.355 of a ttt-3 step). Stages 2 and 3 share
# the 2 cores, so their times add.
t1=$(( PROMPTS * 125 / 1270 ))
t2=$(( PROMPTS * 100 / 197 * MAX_NEW / 256 ))
t3=$(( PROMPTS * 264 * TTT * 355 / 1000 / 1225 * MAX_NEW / 256 ))
say "model $MODEL -> head $HEAD (work files in $WORK)"
echo "  expected time on 2 cores, extrapolated from measured rates (see this script): 1. prompts ~$(hours $t1)"
echo "  2+3. features and training side by side ~$(hours $(( t2 + t3 ))) (features ~$(hours $t2), training ~$(hours $t3))"
echo "  5. evaluate ~5 min. Every stage prints its progress. Rerun to resume after an interruption."
if [ "$VOCAB_SHARDS" -gt "$PENDING" ]; then
    echo "train-draft: VOCAB_SHARDS ($VOCAB_SHARDS) must be at most PENDING ($PENDING): the trainer needs them all at once" >&2
    exit 2
fi
mkdir -p "$WORK/prompts"
t0=$(date +%s)

parts=$(( (PROMPTS + PART - 1) / PART ))
say "1/5 prompts: $PROMPTS in $parts parts, none containing a prompt of $HELDOUT"
part_files=()
for ((p = FIRST_PART; p < FIRST_PART + parts; p++)); do
    dir="$WORK/prompts/part-$(printf %04d "$p")"
    part_files+=("$dir/train.jsonl")
    if [ -s "$dir/train.jsonl" ]; then
        echo "  part $p kept from an earlier run"
        continue
    fi
    n=$(( p == FIRST_PART + parts - 1 ? PROMPTS - (parts - 1) * PART : PART ))
    "$PYTHON" tools/make_seeds.py seeds --count $(( 2 * n )) --seed $(( p + 1 )) --out "$dir.seeds.jsonl"
    "$AERIE" gen-prompts --model "$MODEL" --out "$dir" --count "$n" --heldout 0 --seed $(( p + 1 )) \
        --seeds "$dir.seeds.jsonl" --exclude "$HELDOUT" --max-batch "$BATCH" | tee "$dir.json"
done
"$PYTHON" tools/make_seeds.py merge --out "$WORK/prompts/train.jsonl" --exclude "$HELDOUT" \
    "${part_files[@]}"

say "2+3/5 features (responses of up to $MAX_NEW tokens) and training (ttt $TTT, draft vocabulary $DRAFT_VOCAB), side by side"
"$AERIE" dump-features --model "$MODEL" --prompts "$WORK/prompts/train.jsonl" --out "$WORK/features" \
    --max-new-tokens "$MAX_NEW" --max-batch "$BATCH" --shard-size "$SHARD" --max-pending "$PENDING" \
    --threads 1 >"$WORK/dump-features.json" 2>"$WORK/dump-features.log" &
dump=$!
trap 'kill $dump 2>/dev/null' EXIT
"$PYTHON" tools/train_eagle3.py train --stream --delete-consumed --features "$WORK/features" --out "$WORK/train" \
    --ttt "$TTT" --draft-vocab "$DRAFT_VOCAB" --vocab-shards "$VOCAB_SHARDS" --threads 1 ${INIT:+--init "$INIT"}
wait $dump
trap - EXIT
tail -1 "$WORK/dump-features.log"

say "4/5 export: $WORK/train/head -> $HEAD"
mkdir -p "$HEAD"
cp "$WORK/train/head/config.json" "$WORK/train/head/model.safetensors" "$WORK/train/head/training.json" "$HEAD/"
ls -l "$HEAD"

say "5/5 evaluate on $HELDOUT, up to $EVAL_TOKENS tokens (greedy; plain and the shapes $EVAL_SHAPES, side by side)"
"$AERIE" eval-draft --model "$MODEL" --draft "$HEAD" --prompts "$HELDOUT" --max-new-tokens "$EVAL_TOKENS" \
    --shapes "$EVAL_SHAPES" | tee "$WORK/eval.json"
cp "$WORK/eval.json" "$HEAD/eval-heldout.json"

say "done in $(( ($(date +%s) - t0) / 60 )) min; head in $HEAD, evaluation in $HEAD/eval-heldout.json"
