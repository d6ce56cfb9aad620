#!/usr/bin/env bash
# The GPU checks and figures of issue #7 in one script, for a machine with one NVIDIA GPU (an H200 lent
# by the `device` tool, or any CUDA box). About 6-8 minutes on an H200; every step has its own timeout,
# so a hang in one still leaves the others' results.
#
#   bash scripts/gpu-bench.sh [OUTDIR]      # OUTDIR: $OUT if set (the device tool), else gpu-out/
#   bash scripts/gpu-bench.sh --cpu-smoke   # the same steps, tiny, on the CPU: checks the script itself
#
# It runs from the working tree with the Python that has a CUDA torch (PYTHON, default python3; the
# device machine's image has torch, triton, xxhash, aiohttp, matplotlib): nothing is installed. Steps:
#   1. the engine on CUDA (real streams and events, the Triton attention kernels), tiny model, all four
#      prefill loops, each trace checked (`pdo check`);
#   2. the same with the large preset, `ahead`, checked;
#   2b. a PD run (`pdo run --pd --dp 2`: two prefill ranks, the bootstrap server, decode), decode's
#      attention on the Triton kernels too, in float32 so that its tokens are compared exactly with the
#      torch reference (a mismatch, an abort or a leak fails the step), its three traces checked
#      (added after the last GPU timing: not yet timed on an H200; its limits are 120 + 60 s);
#   3. `pdo bench prefill` with the large preset and the Triton backend: table, JSON and PNG;
#   4. `pdo bench trace-overhead` on the GPU (fewer pairs than on CPU: each run is shorter and steadier);
#   3b. the prefill bench again with GPU-sized batches (up to 4096 tokens; prompts of 256-2048);
#   5. the Triton kernels against torch SDPA (triton_kernels.bench), last: the longest and least needed.
# Results: OUTDIR/summary.txt (every step's output), bench-prefill{,-big}.{json,png}, trace-overhead.json,
# kernels.json (8 files: what the device tool brings back). The steps share GPU_BENCH_BUDGET_S (default
# 560 s): a step's timeout is cut to what is left of it (a cut bench writes no JSON), and with under
# 20 s left a step is skipped; both say so. Record the tables in docs/benchmarks.md with the date and
# this command.
set -uo pipefail

smoke=0
if [[ "${1:-}" == "--cpu-smoke" ]]; then smoke=1; shift; fi
out=${1:-${OUT:-gpu-out}}
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$out/summary.txt"
: >"$log"
failed=0

budget=${GPU_BENCH_BUDGET_S:-560}   # the whole script, under the device tool's 600 s per command
t_end=$((SECONDS + budget))

step() {  # step NAME TIMEOUT_S CMD...: run, log, keep going on failure; skipped when time is short
    local name=$1 limit=$2; shift 2
    local left=$((t_end - SECONDS))
    if (( left < 20 )); then
        echo "-- $name: skipped (${left}s left of the ${budget}s budget)" | tee -a "$log"
        return
    fi
    local cut=""
    if (( limit > left )); then limit=$left; cut=", cut to what is left of the budget"; fi
    echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s$cut): $*" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        echo "!! $name failed (exit $rc)" | tee -a "$log"
        failed=$((failed + 1))
    fi
}

pdo=("$py" -m engine.cli)   # the pdo command from this tree

if [[ $smoke == 1 ]]; then
    # Tiny everything; the Triton kernels through the interpreter for the engine runs, torch attention
    # for the benchmarks (the interpreter would take minutes there): checks the plumbing, not the GPU.
    export TRITON_INTERPRET=1
    dev=(--device cpu) large=(--model tiny) small=(--requests 4 --prompt-len 20:70 --max-batch-tokens 48
        --chunk-size 32 --page-size 8) attn=(--attention-backend torch)
    reps=(--reps 1 --requests 8 --hits 0.8 --modes thread,ahead) to_reps=(--reps 2 --requests 8) kernels=(--smoke)
    reps_big=("${reps[@]}" --max-batch-tokens 64 --chunk-size 32 --prompt-len 40:120)
    # PD on the Triton kernels too (the backend serialises interpreted launches: the interpreter is
    # not thread-safe, and a PD process interprets prefill's and decode's forwards at once)
    pd_attn=(--attention-backend triton)
else
    export TRITON_INTERPRET=0 TRITON_CACHE_AUTOTUNING=1   # tuned once, reused by the later steps
    dev=(--device cuda) large=(--model large) small=() attn=(--attention-backend triton) pd_attn=("${attn[@]}")
    reps=(--reps 6 --requests 300) to_reps=(--reps 100) kernels=()   # 6 rounds of 300, not 9 of 1,000: room for the other steps
    # batches of up to 4096 tokens over prompts of 256-2048 (the default workload's batches are a GPU's
    # smallest: 256 tokens); a KV pool of 64k tokens
    reps_big=(--reps 5 --max-batch-tokens 4096 --chunk-size 1024 --prompt-len 256:2048 --num-pages 4096)
    step "machine" 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv"
    step "torch sees the GPU" 60 "$py" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA';
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    [[ $failed -ne 0 ]] && { echo "no usable GPU: stopping" | tee -a "$log"; exit 1; }
fi

for mode in normal overlap thread ahead; do
    step "1. engine, tiny, $mode" 120 "${pdo[@]}" run "${dev[@]}" --mode "$mode" --attention-backend triton "${small[@]}" \
        --trace "$out/tiny-$mode.jsonl"
    step "1. check tiny-$mode" 60 "${pdo[@]}" check "$out/tiny-$mode.jsonl"
done
step "2. engine, large preset, ahead" 180 "${pdo[@]}" run "${dev[@]}" "${large[@]}" --mode ahead --attention-backend triton \
    "${small[@]}" --trace "$out/large-ahead.jsonl"
step "2. check large-ahead" 60 "${pdo[@]}" check "$out/large-ahead.jsonl"
step "2b. engine, PD, dp 2" 120 "${pdo[@]}" run --pd --dp 2 "${dev[@]}" --dtype float32 --mode ahead "${pd_attn[@]}" \
    "${small[@]}" --trace "$out/pd.jsonl"
step "2b. check pd" 60 "${pdo[@]}" check "$out/pd.decode.jsonl" "$out/pd.prefill0.jsonl" "$out/pd.prefill1.jsonl"
if [[ $failed -eq 0 ]]; then   # all checked and passed: not needed back (a failing one comes back)
    rm -f "$out"/tiny-*.jsonl "$out"/large-ahead.jsonl "$out"/pd.*.jsonl
fi
step "3. bench prefill" 300 "${pdo[@]}" bench prefill "${dev[@]}" "${large[@]}" "${attn[@]}" "${reps[@]}" \
    --json-out "$out/bench-prefill.json" --png "$out/bench-prefill.png"
step "4. bench trace-overhead" 150 "${pdo[@]}" bench trace-overhead "${dev[@]}" "${large[@]}" "${attn[@]}" \
    "${to_reps[@]}" --json-out "$out/trace-overhead.json"
step "3b. bench prefill, GPU-sized batches" 200 "${pdo[@]}" bench prefill "${dev[@]}" "${large[@]}" "${attn[@]}" \
    "${reps_big[@]}" --json-out "$out/bench-prefill-big.json" --png "$out/bench-prefill-big.png"
step "5. Triton kernels vs SDPA" 150 "$py" -m triton_kernels.bench "${kernels[@]}" --json-out "$out/kernels.json"

echo "== done ($(date -u +%H:%M:%S)): $failed step(s) failed; results in $out" | tee -a "$log"
exit $((failed > 0))
