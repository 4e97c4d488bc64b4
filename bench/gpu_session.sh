#!/usr/bin/env bash
# One GPU session's measurements in one command, about 8 minutes on an H100 or H200 (at most 9 by
# the caps below), everything written under $OUT (./gpu-out without it). Stages in order of value,
# each a bench/llama_gpu.py run (every variant in its own process with cold compile caches, the
# bound of each FP8 variant, a profile of one step and Inductor's code in <stage>_code.tgz) capped
# by `timeout`; <STAGE>_S=0 skips a stage. The estimates: a variant's first step (cold compile) as docs/results.md's runs
# measured it, plus about 10 s for its process (imports, CUDA, steps, profile, bare GEMM timings).
# 1. llama_gpu (LLAMA_S=245): Llama-3-8B layer shapes, 2 layers, 2 x 4096 tokens, AdamW. First steps
#    in the fifth run (H100): bf16 24 s, fp8fx tensorwise 33, torchao tensorwise 31, fp8fx rowwise
#    51; fp8fx delayed not yet run (guess 40): about 230 s with the processes, so the last variant
#    is the one a slow machine loses. torchao rowwise (first step 48 s, measured in four runs) left
#    out for stage 2's time: VARIANTS=...,torchao-rowwise and LLAMA_S=300 bring it back.
#    VARIANTS and LLAMA_ARGS (e.g. "--model gpt3-6.7b --seq 2048") change it, TAG names its files
#    (llama_gpu_<TAG>.json ...).
# 2. options (OPTIONS_S=90): stage 1's step as fp8fx rowwise with the memory options, saved
#    activations in FP8 and O2's optimizer Fp8AdamW (fp8fx-rowwise-auto-savedfp8-o2), to set beside
#    stage 1's bf16 and fp8fx-rowwise-auto rows (--beside: targets peak <= 0.75x BF16's, step
#    <= 1.02x fp8fx rowwise's), and Fp8AdamW's step alone beside torch.optim.AdamW(fused=True)'s on
#    the same parameters (target: no slower); the lines under its table. Not run before: rowwise's
#    51 s first step plus the process, about 65 s.
# 3. te_layer (TE_S=75): one GPT layer at TransformerEngine's benchmark shapes (hidden 4096, FFN
#    16384, 32 heads, 4 x 4096 tokens), forward and backward, against TE's published 1.53x / 1.65x.
#    Not run before; the GPT-3 2-layer step compiled in 14-23 s, one layer without embedding, loss
#    or optimizer less: about 3 x 22 s (torchao tensorwise left out for stage 2's time).
# 4. deep (DEEP_S=130): the Llama at 8 layers (26 GiB estimated; the run prints how many layers
#    would fit), 2 warm-up + 5 timed steps. Compiles grow with depth (Dynamo unrolls the layers):
#    on CPU 8 layers' first step took 1.4x (BF16) and 1.6x (fp8fx) 2 layers', so about 35 and 55 s
#    here, 45 + 70 s with the processes.
# Off unless given seconds:
# - CAP_S: the largest batch whose step peaks under 40 GiB and its tokens/s (llama_gpu.py
#   --memory-cap 40) for bf16, torchao rowwise and fp8fx rowwise with both options (the
#   targets: batch >= 1.4x BF16's, tokens/s >= 1.1x torchao's): a run of 35-65 s per batch tried,
#   4 or more per variant, so 11 minutes or more.
# - SELFTEST_S: fp8fx selftest --quick (kernel checks, GEMM timings, the dispatch table): 183 s on
#   the H200's first run, and its table changes what kernels="auto" picks against the runs above.
# - CUDAGRAPHS_S: every recipe under CUDA graphs (llama_gpu.py --variants cudagraphs) on a 1-layer
#   hidden-512 Llama, 256 tokens: 10 small compiles, about 200 s.
# - FUSION_S: bench/fusion_counts.py on the GPU (memory passes of fp8fx's and torchao's casts).
# - LAUNCH_S: bench/launch_overhead.py on the GPU (host time per generated-kernel GEMM call).
# BENCH_ARGS: options added to every stage (a dry run of this script on a CPU:
# BENCH_ARGS="--device cpu --tiny --inner eager --steps 1 --warmup 1" bash bench/gpu_session.sh).
# torchao (not in every GPU image) is installed from wheels in .whl/ when that folder exists.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # fp8fx from this checkout
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$out/gpu.txt"

# stage NAME SECONDS VARIANTS [llama_gpu.py options]: writes $out/NAME.json, NAME.log and NAME_code.tgz
stage() {
    local name=$1 seconds=$2 variants=$3
    shift 3
    [ "$seconds" -gt 0 ] || return 0
    echo "== $name (at most $seconds s)"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout "$seconds" python3 bench/llama_gpu.py --timeout 120 "$@" ${BENCH_ARGS:-} --variants "$variants" --save-code "/tmp/$name" \
        --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
    tar czf "$out/${name}_code.tgz" -C /tmp "$name"
}

if [ "${SELFTEST_S:-0}" -gt 0 ]; then
    timeout "$SELFTEST_S" python3 -m fp8fx selftest --quick --out "$out/selftest.json" 2>&1 | tail -40 | tee "$out/selftest.log"
fi
# shellcheck disable=SC2086  # LLAMA_ARGS is a list of options
stage "llama_gpu${TAG:+_$TAG}" "${LLAMA_S:-245}" \
    "${VARIANTS:-bf16,fp8fx-tensorwise-auto,torchao-tensorwise,fp8fx-rowwise-auto,fp8fx-delayed-auto}" ${LLAMA_ARGS:-}
stage options "${OPTIONS_S:-90}" fp8fx-rowwise-auto-savedfp8-o2 --timeout 85 --beside "$out/llama_gpu${TAG:+_$TAG}.json"
stage te_layer "${TE_S:-75}" bf16,fp8fx-tensorwise-auto,fp8fx-rowwise-auto --model te-layer --timeout 60
stage deep "${DEEP_S:-130}" bf16,fp8fx-tensorwise-auto --layers 8 --warmup 2 --steps 5 --timeout 110
stage memory_cap "${CAP_S:-0}" bf16,torchao-rowwise,fp8fx-rowwise-auto-savedfp8-o2 --memory-cap 40 --timeout 100
stage cudagraphs "${CUDAGRAPHS_S:-0}" cudagraphs --layers 1 --hidden 512 --intermediate 1024 --heads 4 --kv-heads 2 --seq 256 --batch 1 \
    --timeout 60
if [ "${FUSION_S:-0}" -gt 0 ]; then
    timeout "$FUSION_S" python3 bench/fusion_counts.py --device cuda --recipes tensorwise,rowwise,torchao-tensorwise,torchao-rowwise \
        --json "$out/fusion_counts.json" 2>&1 | tail -8 | tee "$out/fusion_counts.log"
fi
if [ "${LAUNCH_S:-0}" -gt 0 ]; then
    timeout "$LAUNCH_S" python3 bench/launch_overhead.py --device cuda --json "$out/launch_overhead.json" 2>&1 | tail -8 | tee "$out/launch_overhead.log"
fi
