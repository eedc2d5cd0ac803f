#!/usr/bin/env bash
# `make train-draft`: trains an EAGLE-3 head for a model with data the model
# makes itself, in five stages, each showing its progress:
#
#   1. prompts   aerie gen-prompts: distinct user turns sampled from the
#                model's chat template (temperature 0.9), a held-out set apart
#   2. features  aerie dump-features: the model answers each training prompt
#                (greedy) and the captured features and top-8 next-token
#                probabilities go to safetensors shards
#   3. train     tools/train_eagle3.py train (PyTorch, CPU)
#   4. export    the head in the published EAGLE-3 layout, copied to HEAD
#   5. evaluate  aerie eval-draft on the held-out prompts: acceptance for
#                three tree shapes, decode tok/s with and without speculation
#
# Every stage resumes: prompts are kept once written, dump-features goes on
# after its last shard, the trainer from its last checkpoint. So an
# interrupted run (Ctrl-C, a reboot) is continued by running it again.
# Settings come from the environment; the defaults made the shipped head.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
WORK=${WORK:-build/train/smollm2}
HEAD=${HEAD:-models/smollm2-135m-eagle3}
PROMPTS=${PROMPTS:-2600}          # distinct prompts, held-out ones included
HELDOUT=${HELDOUT:-100}
MAX_NEW=${MAX_NEW:-256}           # longest response
BATCH=${BATCH:-32}                # sequences generated together
EPOCHS=${EPOCHS:-3}
TTT=${TTT:-3}                     # unrolled draft steps in training
DRAFT_VOCAB=${DRAFT_VOCAB:-4096}
EVAL_PROMPTS=${EVAL_PROMPTS:-100}
EVAL_TOKENS=${EVAL_TOKENS:-256}   # longest answer in the evaluation
PYTHON=${PYTHON:-python3}
AERIE=${AERIE:-build/aerie}

say() { printf '\ntrain-draft: %s\n' "$*"; }

say "model $MODEL -> head $HEAD (work files in $WORK)"
echo "  expected time on a 2-core x86 machine (AVX-512), with the defaults, as measured when the shipped"
echo "  head was made (models/smollm2-135m-eagle3/README.md):"
echo "    1. prompts ~4 min  2. features ~21 min  3. train ~27 min  5. evaluate ~10 min: about 1 hour"
echo "  Every stage prints its progress. Rerun to resume after an interruption."
mkdir -p "$WORK"
t0=$(date +%s)

say "1/5 prompts: $PROMPTS distinct user turns, $HELDOUT held out"
if [ -s "$WORK/prompts/train.jsonl" ] && [ -s "$WORK/prompts/heldout.jsonl" ]; then
    echo "  kept from an earlier run: $WORK/prompts ($(wc -l <"$WORK/prompts/train.jsonl") train," \
         "$(wc -l <"$WORK/prompts/heldout.jsonl") held out)"
else
    "$AERIE" gen-prompts --model "$MODEL" --out "$WORK/prompts" --count "$PROMPTS" --heldout "$HELDOUT" \
        --max-batch "$BATCH" | tee "$WORK/gen-prompts.json"
fi

say "2/5 features: responses of up to $MAX_NEW tokens"
"$AERIE" dump-features --model "$MODEL" --prompts "$WORK/prompts/train.jsonl" --out "$WORK/features" \
    --max-new-tokens "$MAX_NEW" --max-batch "$BATCH" | tee "$WORK/dump-features.json"

say "3/5 train: $EPOCHS epochs, $TTT unrolled steps, draft vocabulary $DRAFT_VOCAB"
"$PYTHON" tools/train_eagle3.py train --features "$WORK/features" --out "$WORK/train" --epochs "$EPOCHS" \
    --ttt "$TTT" --draft-vocab "$DRAFT_VOCAB"

say "4/5 export: $WORK/train/head -> $HEAD"
mkdir -p "$HEAD"
cp "$WORK/train/head/config.json" "$WORK/train/head/model.safetensors" "$WORK/train/head/training.json" "$HEAD/"
ls -l "$HEAD"

say "5/5 evaluate on $EVAL_PROMPTS held-out prompts, up to $EVAL_TOKENS tokens (greedy; plain and three tree shapes, side by side)"
"$AERIE" eval-draft --model "$MODEL" --draft "$HEAD" --prompts "$WORK/prompts/heldout.jsonl" \
    --limit "$EVAL_PROMPTS" --max-new-tokens "$EVAL_TOKENS" | tee "$WORK/eval.json"
cp "$WORK/eval.json" "$HEAD/eval.json"

say "done in $(( ($(date +%s) - t0) / 60 )) min; head in $HEAD, evaluation in $HEAD/eval.json"
