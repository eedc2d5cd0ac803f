#!/usr/bin/env bash
# `make run`. The serving stack (gateway, target, draft) is not built yet;
# until it is, this shows what Aerie can already do with the default model:
# what the file holds, how a chat is tokenized, and an answer from the CPU
# engine, drafted by the model's trained EAGLE-3 head
# (models/smollm2-135m-eagle3, found by --draft auto) and then plainly, with
# the figures of both.
set -euo pipefail
cd "$(dirname "$0")/.."
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
chat='[{"role":"user","content":"What is speculative decoding?"}]'

echo "== aerie info --model $model"
build/aerie info --model "$model"
echo
echo "== aerie tokenize --model $model --chat '$chat'"
ids=$(build/aerie tokenize --model "$model" --chat "$chat")
echo "$ids"
echo
echo "== aerie detokenize (the ids above)"
# shellcheck disable=SC2046
build/aerie detokenize --model "$model" $(tr -d '[]' <<<"$ids" | tr ',' ' ')
echo
echo "== aerie generate --model $model --chat --prompt '$chat' --max-tokens 64 --stats"
echo "   (speculative: the head beside the model, --draft auto)"
build/aerie generate --model "$model" --chat --prompt "$chat" --max-tokens 64 --stats
echo
echo "== the same with --draft none (plain decoding; the text is the same)"
build/aerie generate --model "$model" --chat --prompt "$chat" --max-tokens 64 --stats --draft none
