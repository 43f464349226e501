#!/usr/bin/env bash
# Runs a set of benchmarks on the GPU machine within one device call, each under its own
# timeout, so that what finished comes back even when the call runs out of time. Output goes
# to $OUT/<step>.txt (and .json where the benchmark writes one). After `. .device/c/setup.sh`:
#
#   bash scripts/gpu_bench.sh SET [SET...]      # BUDGET=580 by default (seconds for all steps)
#
# More than 8 files (a device call's limit) come back as $OUT/bench.tar.
#
# Sets:
#   warmup    one short oracle run of the 8B 4-bit shape: a cold machine spends minutes
#             compiling MLX's kernels and outrider's; run it first, in the same call or the one
#             before on the warm machine
#   bars      issue 13's oracle bars, 8B 4-bit and bf16 at caps 2 and 4, with the defaults
#   launches  the fused attention and grouped projections against the paths they replace,
#             in one process each (docs/performance.md, "Fewer launches")
#   barslayers each verify width of the 8B shapes compiled and not (verify_forward_ablation.py
#             --hows native,uncompiled), then the bf16 oracle bar (cap 4) with compiled layers off
#             and on (the default), in turn, twice: a 5-row bf16 verify read 20 ms on an H200
#             in the 49th session, 12 in the 44th, before layers ran compiled
#   softmax   the 8B 4-bit oracle with OUTRIDER_ATTENTION_KERNELS=softmax (an A/B for `bars`)
#   demo      issue 13's demo-pair bar: every mode with `--max-draft auto`, three suites
#   batch     issue 12's batching bar: 32 requests, 8 at a time, against one at a time
#   turn5     issue 12's time to first token at turn 5 (Qwen3-32B shape, every shape new)
#   turn5q    the same with the 32B shape quantized to 4 bits: cold turns and the exact repeat,
#             one run
#   qprefill  quantized products of many rows: MLX's against dequantize + bf16 product
#             (benchmarks/quantized_prefill.py)
#   ttft      where turn 5's time to first token goes on the 32B shape: lookup, the suffix's
#             prefill, against bare forwards (benchmarks/ttft_phases.py)
#   phases    where a batched round's time goes at 1 and 8 rows, demo pair, dspark and
#             baseline (benchmarks/batch_round_phases.py)
#   steps     where the demo pair's rounds go: drafting rounds sorted ahead / serial / after
#             plain steps, fixed caps against auto, chat and code (benchmarks/step_times.py)
#   turn5ab   turn5q's cold turns with the rows kernel and dense prefill chunks (the default)
#             and with OUTRIDER_MATMUL=native (MLX's products everywhere): what they buy
#   qmid      where the dense route starts to pay (128-384 rows, for DENSE_ROWS), and the
#             dense queue's bound (a 32B prefill unbounded, at 2 and at 1 GiB, with peaks)
#   gemm      the rows kernel's gemm form at 24-64 rows (whole, in 2 shares, in the shares it
#             picks, 4 fragments a warp) against MLX's product and the tensor-core form, with
#             each one's error and row-alone check
#   turn5cold turn5q's cold turns alone
#   timeline  where a continuous batch's time goes (prefills, joins, rounds by width) against
#             one at a time, demo pair, dspark and baseline (benchmarks/batch_timeline.py)
#   abtimeline  the dspark timeline of this tree, then of each ab/<hash> tree (an older commit,
#             scripts/ab_tree.sh; carry "ab"), then of this tree again
#   served    issue 12's batching bar as servers run it: the batched arm with MLX's CUDA graphs
#             off (serve --cuda-graphs auto at --max-batch 8), one at a time with them on (a
#             child process), baseline and dspark on the demo pair, baseline and the oracle on
#             a random-weight 0.6B shape (batch_throughput.py --as-served)
#   phases06b where a batched round's time goes on the random 0.6B shape (the oracle at 1 and
#             8 rows, baseline at 8; graphs off, as served), with each graph's nodes
#   timeline06b  where the random 0.6B shape's continuous batch spends its time, the oracle and
#             baseline, graphs off (batch_timeline.py --shape 0.6b)
#   moves     the column moves alone (benchmarks/rollback_moves.py, a 16k-column bf16 buffer)
#   abrollback  the batched rollback against each ab/<hash> tree (carry "ab"): its column moves
#             alone (benchmarks/rollback_moves.py), the 0.6B oracle at 8 rows over
#             2048-token prompts, then the demo pair's dspark timeline
#   trace     what `--max-draft auto` measured against what its steps took, demo pair, dspark
#             and dflash, chat and math (benchmarks/policy_trace.py)
#   parked    what a parked plain step (`--max-draft auto` holding a drafter back) costs against
#             plain decoding's step, with and without lookup copies (benchmarks/parked_steps.py)
#   abtrace   `trace`'s chat run of this tree against each ab/<hash> tree (carry "ab")
#   ablookup  lookup mode with `--max-draft auto` (its copies by match kind), demo target,
#             three suites: each ab/<hash> tree (carry "ab") and this tree, alternating, twice
#   trace2    `trace` on chat with the prompts run twice: first-use costs against steady ones
#   retapfrom `trace` on chat with parked runs tapping their first 32 steps, none and 8 (the
#             default), then 32 again (policy_trace.py --retap-from)
#   intake    a model drafter's call by the context rows it takes in (the prompt, a round's
#             tokens, a parked run's), demo pair, dspark and dflash, chat, cap 4 and auto
#             (benchmarks/drafter_intake.py)
#   firstwidths  what meeting a row count for the first time costs the first round after a
#             long parked run: the drafter's intake and the target's recompute of 9-101 rows,
#             first call against second (drafter_intake.py --rows), demo pair, dspark and dflash
#   retap     parked steps with their taps recomputed where runs end (the default on CUDA)
#             against every step tapped, and plain decoding's step (parked_steps.py
#             --every-step-taps), demo pair, dspark and dflash (RETAP_MODES), chat and code
#   retapab   the demo bar (`demo`) with OUTRIDER_RETAP=off and with the default, in turn, twice
#   plainstep where a plain step's time goes, mlx-lm's loop against outrider's (build, launch,
#             wait), 8B shape 4-bit and bf16 and the demo target (benchmarks/plain_step.py)
#   compiled  a one-row step with each layer's static-shape blocks compiled against mlx-lm's
#             own (benchmarks/compiled_blocks.py), 8B 4-bit and bf16, 0.6B bf16
#   merged    `compiled` with a third arm: q/k/v and gate/up each as one product (--merged)
#   layers    outrider's compiled layers (the CUDA default) against the layers' own, in one
#             process (plain_step.py: outrider, uncompiled, mlx-lm), demo target and 0.6B bf16
#   layers8b  the same on the 8B shape, 4-bit and bf16 (a call of its own)
#   layersdemo the demo bar (`demo`'s benchmark) with compiled layers, one process
#   drafters  the demo pair's drafter calls and whole rounds with the drafter compiled (the
#             CUDA default) and op by op, in one process (benchmarks/round_profile.py)
#   rowtests  the GPU tests of the rows kernel (each form against MLX's product, each row
#             against itself alone, 1-64 rows; a template compiles per group count). Needs
#             pytest: carry .whl (docs/testing-on-gpu.md); ROWTESTS=EXPR picks them (-k)
set -u
out=${OUT:-/tmp/gpu_bench}
mkdir -p "$out"
budget=${BUDGET:-580}

step() {  # step NAME SECONDS COMMAND...: run it, capped by what the budget has left
  local name=$1 limit=$2 left
  shift 2
  left=$((budget - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left}s left" | tee -a "$out/skipped.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, at ${SECONDS}s)"
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "rc=$? at ${SECONDS}s" >> "$out/$name.txt"
  grep -E "tok/s|^ +[0-9>-]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9]+$|^cap |plain steps|drafting rounds|plain p90|round x|prefill |join |elsewhere|plain \(|cap pipe|^ +[0-9]+ +on|^8b|^S |w5|rc=|Error|passed|failed|^turn 5|^exact repeat|rows kernel|the faster|^(propose|verify|settle|rollback|round|nodes|tokens a)|peak added|x baseline|^  phases|after plain steps|lookup +auto|^  (chat|code|math) | a step \(|×" "$out/$name.txt"
}

demo_bench() {  # demo_bench NAME SECONDS MODES [ENV=VALUE...]: issue 13's demo bar, three
  # suites of 10 prompts, 128 tokens, `--max-draft auto`, receipt NAME.json
  local name=$1 limit=$2 modes=$3
  shift 3
  step "$name" "$limit" env "$@" python3 -m outrider benchmark --model outrider-demo/target \
    --dspark-drafter outrider-demo/dspark --dflash-drafter outrider-demo/dflash \
    --modes "$modes" --suites chat,code,math --trials 1 --prompts-per-suite 10 \
    --max-tokens 128 --max-draft auto --json "$out/$name.json"
}

export PYTHONUNBUFFERED=1
loop="python3 benchmarks/loop_efficiency.py --shapes 8b --prompt-len 256"
# every set the dispatch below runs, in one list: a wrong name fails before anything runs
sets="warmup bars barslayers softmax launches demo batch turn5 turn5q qprefill ttft steps phases
  turn5ab qmid rowtests gemm turn5cold timeline abtimeline served phases06b abrollback moves timeline06b trace
  trace2 abtrace parked intake ablookup plainstep retap retapab retapfrom compiled layers layers8b
  layersdemo merged drafters firstwidths"
for set in "$@"; do
  case " $(echo $sets) " in
    *" $set "*) ;;
    *) echo "gpu_bench.sh: no set named $set ($(echo $sets | sed 's/ /, /g'))" >&2; exit 2 ;;
  esac
done
{ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"; } \
  | tee "$out/gpu.txt"
# the `outrider` command keeps MLX's compiled CUDA kernels in outrider's cache where nobody
# chose a folder (core/paths.py `keep_kernels`), the scripts in MLX's default: one folder for
# both, or a fresh host compiles each kernel twice (18-46 s apiece for quantized ones)
MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx/$(python3 -c 'import mlx.core as m; print(m.__version__)')/ptx}"
export MLX_PTX_CACHE_DIR
for set in "$@"; do
  case "$set" in
    warmup)
      step warmup 300 $loop --dtypes 4bit --caps 4 --trials 1 --new-tokens 16 ;;
    bars)
      step loop_8b_4bit 120 $loop --dtypes 4bit --caps 2,4 --trials 3 --new-tokens 128 \
        --json "$out/loop_8b_4bit.json"
      step loop_8b_bf16 180 $loop --dtypes bf16 --caps 2,4 --trials 3 --new-tokens 128 \
        --json "$out/loop_8b_bf16.json" ;;
    barslayers)
      # each verify width with compiled layers and with the layers' own, in one process
      step verify_widths_layers 150 python3 benchmarks/verify_forward_ablation.py --shape 8b \
        --dtypes bf16,4bit --contexts 256 --widths 1,3,5,8 --hows native,uncompiled,native --reps 9
      i=0
      for arm in off auto off auto; do
        i=$((i + 1))
        step "loop_8b_bf16_layers${i}_$arm" 110 env OUTRIDER_COMPILED_LAYERS=$arm $loop \
          --dtypes bf16 --caps 4 --trials 3 --new-tokens 128 \
          --json "$out/loop_8b_bf16_layers${i}_$arm.json"
      done ;;
    softmax)
      step loop_8b_4bit_softmax 120 env OUTRIDER_ATTENTION_KERNELS=softmax $loop \
        --dtypes 4bit --caps 2,4 --trials 3 --new-tokens 128 \
        --json "$out/loop_8b_4bit_softmax.json" ;;
    launches)
      step forward_fused_ab 150 python3 benchmarks/verify_forward_ablation.py --shape 8b \
        --dtypes 4bit,bf16 --contexts 256,1024,2048 --widths 1,3,5,8 --hows native,softmax \
        --reps 9
      step attention_fused_ab 90 python3 benchmarks/verify_forward_ablation.py --sdpa \
        --contexts 256,1024,2048,4224 --widths 5,8 --kinds bucket,fused
      step quantized_rows 120 python3 benchmarks/quantized_rows.py --skip 1,2 --reps 3 \
        --json "$out/quantized_rows.json" ;;
    demo)
      demo_bench demo_auto 540 baseline,dspark,dflash,lookup ;;
    batch)
      step batch_demo 300 python3 benchmarks/batch_throughput.py --modes baseline,dspark \
        --batch 8 --requests 32 --suite code,math,chat --max-tokens 128 --repeats 3 \
        --json "$out/batch_demo.json" ;;
    steps)
      for suite in chat code; do
        step "steps_$suite" 120 python3 benchmarks/step_times.py --suite "$suite" --prompts 5 \
          --caps 2,4,auto
      done
      # every guess queued: where a round after a dropped one spends its time
      step steps_chat_on 90 env OUTRIDER_PIPELINED_ROUNDS=on python3 benchmarks/step_times.py \
        --suite chat --prompts 5 --caps 4 ;;
    turn5)
      step turn5_32b 420 python3 benchmarks/prefix_cache.py --shape 32b --dtype bf16 \
        --system-tokens 4096 --turns 5 --cold --json "$out/turn5_32b.json" ;;
    turn5q)  # --cold times the exact repeat too: one 32B build for both of issue 12's ratios
      step turn5_32b_4bit 450 python3 benchmarks/prefix_cache.py --shape 32b --dtype 4bit \
        --system-tokens 4096 --turns 5 --cold --json "$out/turn5_32b_4bit.json" ;;
    phases)
      step batch_phases_dspark 150 python3 benchmarks/batch_round_phases.py --batches 1,2,8 \
        --max-tokens 128 --split
      step batch_phases_baseline 90 python3 benchmarks/batch_round_phases.py --mode baseline \
        --batches 1,8 --max-tokens 128 ;;
    qprefill)
      step quantized_prefill 200 python3 benchmarks/quantized_prefill.py --rows 16,64,512 \
        --reps 5 ;;
    turn5ab)
      step turn5_32b_4bit_rows 200 python3 benchmarks/prefix_cache.py --shape 32b --dtype 4bit \
        --system-tokens 4096 --turns 5 --cold --json "$out/turn5_32b_4bit_rows.json"
      step turn5_32b_4bit_native 200 env OUTRIDER_MATMUL=native python3 \
        benchmarks/prefix_cache.py --shape 32b --dtype 4bit --system-tokens 4096 --turns 5 \
        --cold --json "$out/turn5_32b_4bit_native.json" ;;
    qmid)
      step quantized_prefill_mid 90 python3 benchmarks/quantized_prefill.py --shape 8b,32b \
        --rows 128,256,384 --reps 5 --prefill 0
      step dense_queue_32b 150 python3 benchmarks/quantized_prefill.py --shape 32b --rows 512 \
        --reps 3 --queue-gb 0,2,1 ;;
    rowtests)
      if [ -d .whl ]; then
        pip install -q --no-index --no-deps --target /tmp/testsite .whl/*.whl 2>/dev/null
        export PYTHONPATH=/tmp/testsite:${PYTHONPATH:-}
      fi
      step row_kernel_tests 400 python3 -m pytest -o addopts="" -q -rs tests/test_cuda_rows.py \
        -k "${ROWTESTS:-computes_mlxs_product or grouped_form or builtin_plugin}" ;;
    gemm)
      step quantized_gemm 240 python3 benchmarks/quantized_prefill.py --shape 32b,8b \
        --rows 24,40,64 --reps 7 --prefill 0 --gemm 2x8x1,2x8x2,2x8,4x8 ;;
    timeline)
      step timeline_dspark 260 python3 benchmarks/batch_timeline.py --mode dspark
      step timeline_baseline 120 python3 benchmarks/batch_timeline.py --mode baseline ;;
    abtimeline)
      # this tree against each ab/<hash> (scripts/ab_tree.sh; carry "ab"), new, old, new
      bash scripts/ab_tree.sh --weights
      step timeline_new 240 python3 benchmarks/batch_timeline.py --mode dspark
      for tree in ab/*/; do
        [ -d "$tree" ] || continue
        name=$(basename "$tree")
        step "timeline_$name" 120 env -C "$tree" PYTHONPATH="/root/mlx-site:$PWD/$tree" \
          python3 benchmarks/batch_timeline.py --mode dspark
      done
      step timeline_new_again 120 python3 benchmarks/batch_timeline.py --mode dspark ;;
    served)
      step batch_served 420 python3 benchmarks/batch_throughput.py --modes baseline,dspark \
        --batch 8 --requests 32 --suite code,math,chat --max-tokens 128 --repeats 3 \
        --as-served --json "$out/batch_served.json"
      step batch_served_06b 300 python3 benchmarks/batch_throughput.py --shape 0.6b --dtype bf16 \
        --modes baseline,oracle --batch 8 --requests 32 --max-tokens 128 --repeats 1 \
        --as-served --json "$out/batch_served_06b.json" ;;
    phases06b)
      step phases_06b_oracle 120 env MLX_USE_CUDA_GRAPHS=0 python3 \
        benchmarks/batch_round_phases.py --shape 0.6b --mode oracle --batches 1,8 \
        --max-tokens 64
      step phases_06b_baseline 70 env MLX_USE_CUDA_GRAPHS=0 python3 \
        benchmarks/batch_round_phases.py --shape 0.6b --mode baseline --batches 8 \
        --max-tokens 32 ;;
    timeline06b)
      step timeline_06b_oracle 200 env MLX_USE_CUDA_GRAPHS=0 python3 \
        benchmarks/batch_timeline.py --shape 0.6b --mode oracle
      step timeline_06b_baseline 200 env MLX_USE_CUDA_GRAPHS=0 python3 \
        benchmarks/batch_timeline.py --shape 0.6b --mode baseline ;;
    moves)
      step rollback_moves 40 python3 benchmarks/rollback_moves.py --columns 16384 \
        --dtype bfloat16 ;;
    abrollback)
      bash scripts/ab_tree.sh --weights
      long="benchmarks/batch_round_phases.py --shape 0.6b --mode oracle --batches 8 \
        --prompt-len 2048 --max-tokens 40"
      step rollback_moves 40 python3 benchmarks/rollback_moves.py --columns 16384 \
        --dtype bfloat16
      step rollback_long_new 80 env MLX_USE_CUDA_GRAPHS=0 python3 $long
      for tree in ab/*/; do
        [ -d "$tree" ] || continue
        name=$(basename "$tree")
        step "rollback_long_$name" 80 env -C "$tree" PYTHONPATH="/root/mlx-site:$PWD/$tree" \
          MLX_USE_CUDA_GRAPHS=0 python3 $long
        step "timeline_$name" 90 env -C "$tree" PYTHONPATH="/root/mlx-site:$PWD/$tree" \
          MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/batch_timeline.py --mode dspark
      done
      step timeline_new 90 env MLX_USE_CUDA_GRAPHS=0 python3 benchmarks/batch_timeline.py \
        --mode dspark ;;
    trace)
      for suite in chat math; do
        step "policy_trace_$suite" 120 python3 benchmarks/policy_trace.py --modes dspark,dflash \
          --suite "$suite" --prompts 10 --json "$out/policy_trace_$suite.json"
      done ;;
    retapfrom)
      # where parked runs stop tapping (RETAP_FROM, core/parked.py): 32, every step recomputed
      # (0), 8 (the default), then 32 again; read the rounds after plain steps and their launch
      i=0
      for n in 32 0 8 32; do
        i=$((i + 1))
        step "trace_retap${i}_from_$n" 60 python3 benchmarks/policy_trace.py --modes dspark,dflash \
          --suite chat --prompts 10 --retap-from "$n"
      done ;;
    retap)
      for suite in chat code; do
        step "parked_retap_$suite" 150 python3 benchmarks/parked_steps.py \
          --modes "${RETAP_MODES:-dspark,dflash}" --suite "$suite" --prompts 10 --passes 2 \
          --forwards 0 --every-step-taps
      done ;;
    retapab)
      for run in 1 2; do
        for how in off auto; do
          demo_bench "demo_retap_${how}_$run" 150 baseline,dspark,dflash OUTRIDER_RETAP=$how
        done
      done ;;
    compiled)
      for sd in "8b 4bit" "8b bf16" "0.6b bf16"; do
        read -r shape dtype <<< "$sd"
        step "compiled_blocks_${shape}_$dtype" 180 python3 benchmarks/compiled_blocks.py \
          --shape "$shape" --dtype "$dtype" --trials 4
      done ;;
    merged)  # compiled blocks, and q/k/v and gate/up each as one product
      for sd in "8b 4bit" "8b bf16" "0.6b bf16"; do
        read -r shape dtype <<< "$sd"
        step "merged_blocks_${shape}_$dtype" 120 python3 benchmarks/compiled_blocks.py \
          --shape "$shape" --dtype "$dtype" --trials 6 --merged
      done ;;
    layers)  # compiled layers (core/compiled_layers.py) against the layers' own, in-process;
      # read the paired column (the host drifts between trials)
      step layers_demo 120 python3 benchmarks/plain_step.py --model outrider-demo/target \
        --trials 8 --arms mlx-lm,outrider,uncompiled
      step layers_0.6b_bf16 180 python3 benchmarks/plain_step.py --shape 0.6b --dtype bf16 \
        --trials 10 --arms outrider,uncompiled,mlx-lm ;;
    layers8b)  # the same on the 8B shapes (a call of its own: 8 trials of three arms each)
      for dtype in 4bit bf16; do
        step "layers_8b_$dtype" 270 python3 benchmarks/plain_step.py --shape 8b \
          --dtype "$dtype" --trials 8 --arms outrider,uncompiled,mlx-lm
      done ;;
    layersdemo)
      demo_bench demo_layers 300 baseline,dspark,dflash,lookup ;;
    drafters)
      step round_profile_demo 240 python3 benchmarks/round_profile.py --caps 4,7 --reps 100 ;;
    plainstep)
      for dtype in 4bit bf16; do
        step "plain_step_8b_$dtype" 200 python3 benchmarks/plain_step.py --shape 8b \
          --dtype "$dtype" --trials 4 --taps 1,9,17,25,33
      done
      step plain_step_demo 120 python3 benchmarks/plain_step.py --model outrider-demo/target \
        --trials 8 --taps 1,2,3,4,5 ;;
    parked)
      for suite in chat code; do
        step "parked_steps_$suite" 150 python3 benchmarks/parked_steps.py --modes dspark,dflash \
          --suite "$suite" --prompts 10 --passes 2
      done ;;
    abtrace)
      # this tree against each ab/<hash> (scripts/ab_tree.sh; carry "ab"): the first pass of
      # `trace` on chat, where the rounds after parked runs meet new shapes
      bash scripts/ab_tree.sh --weights
      step trace_new 90 python3 benchmarks/policy_trace.py --modes dspark,dflash --suite chat \
        --prompts 10
      for tree in ab/*/; do
        [ -d "$tree" ] || continue
        step "trace_$(basename "$tree")" 90 env -C "$tree" PYTHONPATH="/root/mlx-site:$PWD/$tree" \
          python3 benchmarks/policy_trace.py --modes dspark,dflash --suite chat --prompts 10
      done ;;
    ablookup)
      lookup="-m outrider benchmark --model outrider-demo/target --modes baseline,lookup \
        --suites chat,code,math --trials 1 --prompts-per-suite 10 --max-tokens 128 --max-draft auto"
      bash scripts/ab_tree.sh --weights
      for pass in 1 2; do
        for tree in ab/*/; do
          [ -d "$tree" ] || continue
          step "lookup_$(basename "$tree")_$pass" 90 env -C "$tree" \
            PYTHONPATH="/root/mlx-site:$PWD/$tree" python3 $lookup
        done
        step "lookup_new_$pass" 90 python3 $lookup --json "$out/lookup_new_$pass.json"
      done ;;
    trace2)
      step policy_trace_chat_2 200 python3 benchmarks/policy_trace.py --modes dspark,dflash \
        --suite chat --prompts 10 --passes 2 --json "$out/policy_trace_chat_2.json" ;;
    intake)
      for mode in dspark dflash; do
        step "drafter_intake_$mode" 120 python3 benchmarks/drafter_intake.py --mode "$mode" \
          --suite chat --prompts 10 --caps 4,auto
      done ;;
    firstwidths)
      for mode in dspark dflash; do
        step "first_widths_$mode" 150 python3 benchmarks/drafter_intake.py --mode "$mode" \
          --rows 9,17,23,33,45,70,101
      done ;;
    turn5cold)
      step turn5_32b_4bit 260 python3 benchmarks/prefix_cache.py --shape 32b --dtype 4bit \
        --system-tokens 4096 --turns 5 --cold --json "$out/turn5_32b_4bit.json" ;;
    ttft)
      step ttft_phases_32b 300 python3 benchmarks/ttft_phases.py --shape 32b --dtype bf16 \
        --system-tokens 4096 --turns 5 --repeats 5 ;;
  esac
done
# A device call hands back at most 8 files: past that, everything goes back as one tar
# (`tar -xf bench.tar` where it lands)
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$out" && tar -cf bench.tar --remove-files -- *.txt *.json 2>/dev/null)
  echo "== $(tar -tf "$out/bench.tar" | wc -l) files in $out/bench.tar"
fi
