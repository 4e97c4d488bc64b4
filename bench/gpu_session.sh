#!/usr/bin/env bash
# One GPU session's measurements in one command, everything written under $OUT (./gpu-out without it):
# 1. fp8fx selftest --quick (kernels against the CPU reference, GEMM timings, the dispatch table),
#    when SELFTEST_S > 0: the fp8fx steps below then run each FP8 GEMM on the kernel it measured
#    faster (kernels="auto"; fp8fx-<recipe>-scaled_mm keeps every GEMM on cuBLAS);
# 2. bench/llama_gpu.py: BF16, torchao and fp8fx training steps of a Llama-3-8B-shaped model, each
#    variant in its own process, with a profile of one step and Inductor's code (llama_code.tgz);
# 3. bench/fusion_counts.py on the GPU: the memory passes fp8fx's and torchao's casts add, from the
#    kernels Inductor's GPU backend made (tensorwise and rowwise), when FUSION_S > 0;
# 4. bench/launch_overhead.py on the GPU: host time per generated-kernel GEMM call, beside
#    torch._scaled_mm's, when LAUNCH_S > 0.
# LLAMA_S and SELFTEST_S bound each stage in seconds; VARIANTS picks llama_gpu.py's variants,
# LLAMA_ARGS adds options (e.g. "--model gpt3-6.7b --seq 2048"), TAG names this stage's files
# (llama_gpu_<TAG>.json ...) so that several stages can write to one $OUT.
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
if [ "${SELFTEST_S:-0}" -gt 0 ]; then
    timeout "$SELFTEST_S" python3 -m fp8fx selftest --quick --out "$out/selftest.json" 2>&1 | tail -40 | tee "$out/selftest.log"
fi
variants=${VARIANTS:-bf16,fp8fx-tensorwise-auto,torchao-tensorwise,fp8fx-rowwise-auto,torchao-rowwise,fp8fx-tensorwise-scaled_mm}
name=llama_gpu${TAG:+_$TAG}
# shellcheck disable=SC2086  # LLAMA_ARGS is a list of options
timeout "${LLAMA_S:-420}" python3 bench/llama_gpu.py ${LLAMA_ARGS:-} --variants "$variants" --timeout 120 --save-code "/tmp/$name" \
    --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
tar czf "$out/${name}_code.tgz" -C /tmp "$name"
if [ "${FUSION_S:-0}" -gt 0 ]; then
    timeout "$FUSION_S" python3 bench/fusion_counts.py --device cuda --recipes tensorwise,rowwise,torchao-tensorwise,torchao-rowwise \
        --json "$out/fusion_counts.json" 2>&1 | tail -8 | tee "$out/fusion_counts.log"
fi
if [ "${LAUNCH_S:-0}" -gt 0 ]; then
    timeout "$LAUNCH_S" python3 bench/launch_overhead.py --device cuda --json "$out/launch_overhead.json" 2>&1 | tail -8 | tee "$out/launch_overhead.log"
fi
