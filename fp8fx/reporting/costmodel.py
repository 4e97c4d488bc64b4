"""Predicted time of each GEMM of a report in BF16 and in FP8 on a target GPU, and of a whole step.

The model, per GEMM (an `OpRecord`):

- GEMM time = launch + max(compute, memory). Compute splits the output into 128x128 tiles (times
  the batch) that run in waves over the SMs; each wave costs the tile's main loop over K at
  `gemm_efficiency` (FP8, FP4) or `bf16_efficiency` of the dense peak shared by the SMs, plus `tile_overhead_us` (filling the
  operand pipeline, storing the output tile). So a partly filled last wave is paid whole, short-K
  GEMMs reach less of the peak, and FP8, whose main loop runs twice as fast, loses relatively
  more to the fixed part. An output of fewer tiles than SMs is split along K (split-K, parts of at
  least `SPLIT_K_MIN` of K) as cuBLAS and CUTLASS do. Memory moves both operands (2 bytes an
  element in BF16, 1 in FP8, half in NVFP4) and the BF16 output at `memory_efficiency` of HBM
  bandwidth. Rowwise, blockwise and MXFP8 kernels run their main loop at `rowwise_efficiency` /
  `blockwise_efficiency` / `mx_efficiency` of the tensorwise rate (per-row scales in the epilogue;
  blockwise promotes partial sums to FP32 every 128 of K; MXFP8's 1x32 E8M0 block scales are
  applied by Blackwell's tensor cores). NVFP4 GEMMs (`formats` ("nvfp4", "nvfp4"), 1x16 blocks of
  E4M3 scales) run at `nvfp4_efficiency` of the FP4 peak. MXFP8 and NVFP4 need a target with
  block-scaled tensor cores (an FP4 peak: Blackwell); on Hopper they have no rate (an error).
- The passes FP8 adds. Where the report counted them (`OpRecord.memory_passes_added`: fp8fx's
  casts, which Inductor fuses into neighbouring kernels), each pass moves an operand-sized tensor
  (`PASS_BYTES` an element) at `memory_efficiency` of bandwidth, one launch per two passes.
  Otherwise (a record built by hand, another library's recipe) the passes of an unfused recipe,
  each one kernel (`launch_us`) streaming bytes at `cast_efficiency` of HBM bandwidth (quantize
  kernels reach less of it than a copy), from a 2-byte (BF16) source:
  - tensorwise: each tensor is cast once and the FP8 copy shared, charged on one GEMM: the input
    and the weight on `output`, grad_output on `grad_input`. A cast reads 2 and writes 1 byte an
    element; dynamic scaling adds an amax pass before it (reads 2), delayed scaling takes the amax
    inside the cast. Hopper's FP8 tensor cores read both operands K-major, so there the weight
    (for grad_input), grad_output and the input (for grad_weight) also need a transposed FP8 copy
    (reads 1, writes 1), charged on the GEMM that reads it; Blackwell's read either major
    (`fp8_transposes` False): no copies.
  - rowwise, blockwise, MXFP8 and NVFP4: scales follow each GEMM's layout, so every GEMM casts
    both of its operands from the BF16 tensor, written in the layout it reads: no sharing, no
    transposed copies (each tensor of a linear is cast twice, once along each dimension, as
    torchao's MX training does). Rowwise and blockwise take an amax pass first; MXFP8 takes its
    block amax inside the cast (one kernel, writing 1 + 1/32 bytes an element with the scales);
    NVFP4 takes an amax pass for its per-tensor second-level scale, then writes 0.5 + 1/16.
  - In an inference graph the weight is quantized once when the model is converted, not per
    call: only the activation is cast.
- A GEMM kept high costs its BF16 time in both columns. Fused attention (`sdpa`) is one kernel
  running its counted FLOPs (the full square) at `attention_efficiency` of the BF16 peak; its
  score matrix is never stored. A
  convolution (op `conv`, always high) costs the BF16 time of its implicit GEMM; a grouped one
  (depthwise) is one kernel bound by its FLOPs at `gemm_efficiency` or by streaming its implicit
  GEMM's operands and output, whichever is longer (an overlapping window's input is counted once per
  kernel tap: an upper bound). A GEMM with a dynamic (symbolic) dimension has no prediction.
- A grouped GEMM (op `grouped_mm`, a mixture-of-experts layer's G experts) is G GEMMs in one
  kernel, its routed rows taken as spread evenly over the groups (the router decides them): the
  forward and grad_input (2-D x 3-D) are G GEMMs of M/G rows, reading every expert's weight, the
  grad_weight (2-D x 2-D) G GEMMs over K/G each; FP8 and its passes as for any GEMM.

A step (`predict_step`) is the sum of its GEMMs plus what FP8 leaves as it is, the same in BF16
and FP8: attention; the bytes the other ops move (`Report.non_gemm_bytes`: norms, elementwise,
cross-entropy, embeddings) at `memory_efficiency` of HBM bandwidth; and, for a training step, the
optimizer (`optimizer_us`: torch's AdamW over every trainable parameter, embeddings and LM head
included). These dilute the GEMMs' speedup: a step gains less than its GEMMs do (docs/cost-model.md,
"What a predicted step holds"). Communication, recomputation and host overheads are outside the
model (the measured steps are GPU-bound).

The Hopper targets (`_HOPPER`) are calibrated on fp8fx's own steps (bench/llama_gpu.py, docs/results.md
"On a GPU": the H200 "Third run" profile and steps); `bench/predict_steps.py` prints the predicted
against the measured step speedups, including the H100 runs the calibration did not use
(docs/cost-model.md, "Predicted against measured step speedups"). The other targets keep the
calibration on published figures below. `tests/reporting/test_costmodel.py` checks the predictions
against published figures, each table with its tolerance (docs/cost-model.md, "Checks against
published figures", lists every row with its prediction): TransformerEngine's GEMM-level speedups
on H200 for a 5B-shaped layer (delayed, current and block scaling, and the raw kernel); TE's
per-GEMM Fprop times on B300 for BF16, FP8 current and delayed, MXFP8 and NVFP4, and its per-layer
totals on B300 and H200; DeepGEMM's blockwise TFLOP/s on H800; torchao's MXFP8 inference speedup
for M=K=N on B200; torchao's Llama3-8B training step on H100 (tensorwise and rowwise) and the
trends of a GPT-3-shaped block sweep (TP=8). The main-loop, blockwise, MXFP8, NVFP4 and cast
efficiencies were set on those tables, so they are a calibration, not independent checks. On
Hopper, fp8fx's measured rates replace the main-loop and rowwise ones (TE's H200 figures are then
held as speedups).

Not captured (docs/cost-model.md, "Known limits", has the figures): the kernel a library picks
for a small output (DeepGEMM's narrow tiles without split-K, slower or faster than predicted by
shape); kernel-only timings (the launch is always charged); TE's quantization beyond the passes
above (its current-scaling B300 layer spends more time quantizing than the model has) and TE's
single MXFP8 quantize into both layouts; power and clock limits (TE's BF16 GEMMs on B300 reach
different fractions of peak by shape); NVFP4's random Hadamard transform and 2D weight blocks. In a
step: the other ops' bytes count each op's result once, so an op Inductor runs as several kernels
but the graph holds as one (LayerNorm) counts less than one the graph holds decomposed (RMSNorm):
the GPT-3-shaped step's other ops are under-predicted; an analysis counts the casts' passes as the
ops run one by one, not from Inductor's kernels; flash attention (no explicit mask, causal) runs
faster than `attention_efficiency`; no per-shape GEMM rates (cuBLAS's small FP8 GEMMs run further
from the peak than the tile model says).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fp8fx.core.patterns import BY_KIND
from fp8fx.reporting.op_record import OpRecord

TILE = 128  # output tile edge (both formats): the unit of wave quantization
SPLIT_K_MIN = 512  # split-K never leaves a part shorter than this along K
HIGH_BYTES = 2  # bytes an element of the high-precision (BF16) tensors
# Bytes an element a pass the report counted moves (`_counted_passes_us`). The count is that of the
# ops one by one in an analysis; Inductor takes most amaxes inside the kernel producing the tensor,
# so the BF16 reads it counts cost less than 2 bytes: 1 fits the tensorwise Llama step on the H200
# (docs/results.md, "Third run": 51.4 ms, less its 19.2 ms of FP8 GEMMs, AdamW and the BF16 step's
# other parts, leaves 2.6-2.9 ms of casts; predicted 2.9).
PASS_BYTES = 1.0
OPTIMIZER_PASSES = 21  # parameter-sized reads and writes of torch's foreach AdamW step (see `optimizer_us`)


@dataclass(frozen=True)
class GpuSpec:
    """A target GPU: datasheet peaks, and the achievable fractions the model applies to them."""

    name: str
    fp8_tflops: float  # dense tensor-core peak
    bf16_tflops: float
    hbm_tbps: float  # memory bandwidth, TB/s
    sms: int
    # Fraction of the dense peak a GEMM's main loop sustains. With the tile overhead and wave
    # quantization below, large BF16 GEMMs come out at 0.65-0.68 of peak (660-680 TFLOP/s on H100
    # SXM, 1.47-1.53 PFLOP/s on B300): TE's published B300 BF16 GEMMs run at 0.66-0.77 of peak and
    # its H200 layer at 0.61, DeepGEMM's large blockwise FP8 GEMMs at up to 0.72 of the FP8 peak
    # (PUBLISHED.md A, B). FP8 and FP4 kernels at the same fraction of theirs. The Hopper targets
    # carry fp8fx's own measured rates instead (`_HOPPER`).
    gemm_efficiency: float = 0.72
    # The same for BF16 GEMMs; None: `gemm_efficiency`.
    bf16_efficiency: float | None = None
    # Fused attention (SDPA) over the FLOPs fp8fx counts for it (the full score square; backward
    # twice forward), as a fraction of the BF16 peak. What a `transformers` model gets under
    # torch.compile before torch 2.14: an explicit causal mask, so SDPA's memory-efficient kernel
    # over the full square, not flash attention. docs/results.md, "Third run" (H200): the BF16 step
    # (64.4 ms) less its GEMMs (35.0 ms of aten::mm in the profile), its AdamW step (9.24 ms) and
    # the other ops as predicted (7.2 ms) leaves 12.9 ms for 3.3 TFLOP of attention: 0.26.
    attention_efficiency: float = 0.26
    # Fraction of HBM bandwidth the optimizer's kernels reach (`optimizer_us`). H200: measured lower
    # (see TARGETS).
    optimizer_efficiency: float = 0.85
    # Fraction of HBM bandwidth a GEMM's operand streaming, the non-GEMM ops and the passes the
    # report counted reach (DeepGEMM's memory-bound M=64 GEMMs on H800 move up to 0.80 of it,
    # PUBLISHED.md B).
    memory_efficiency: float = 0.85
    # Fraction of HBM bandwidth the unfused amax / cast / transpose passes reach. Measured
    # quantize kernels sit below a plain copy: torchao's MXFP8 quantize on B200 at 74-82% of
    # bandwidth (PUBLISHED.md C, by its own byte count), and TE's quantization on B300 costs
    # (autocast minus pre-quantized per-layer time) more than 0.85 of bandwidth would give.
    cast_efficiency: float = 0.7
    # Hopper's FP8 tensor cores read both operands K-major: GEMMs that read an operand the other
    # way need a transposed FP8 copy of it (tensorwise). Blackwell's read either major: no copies.
    fp8_transposes: bool = True
    # Launching one kernel and draining it: what a small kernel costs however little it does.
    launch_us: float = 3.0
    # Per wave of tiles, time outside the main loop (pipeline fill, output-tile store): at K=4096
    # about 4% of a BF16 tile's time and 8% of an FP8 one's.
    tile_overhead_us: float = 1.0
    # Main-loop rate of rowwise and blockwise FP8 GEMMs relative to tensorwise. Rowwise: PyTorch's
    # CUTLASS kernel runs most shapes at 90-100% of tensorwise, with a tail lower
    # (pytorch/pytorch#147971). Blockwise (FP32 promotion every 128 of K): DeepGEMM overlaps the
    # promotion with the tensor cores (1426 TFLOP/s at 4096x7168x16384 on H800, PUBLISHED.md B) and
    # TE's H200 block recipe gains 1.41x; slower kernels exist (FBGEMM's 2024 one at ~75% of its
    # rowwise, pytorch/FBGEMM#2546), which the model does not follow.
    rowwise_efficiency: float = 0.9
    blockwise_efficiency: float = 0.95
    # MXFP8 (1x32 blocks, E8M0 scales) on Blackwell: the tensor cores apply the block scales
    # (tcgen05 block-scaled MMA), so the main loop runs near the tensorwise rate. TE's pre-quantized
    # per-layer totals on B300 (PUBLISHED.md A: MXFP8 7.161 ms vs FP8 current 6.812) put it at 0.95.
    mx_efficiency: float = 0.95
    # Dense NVFP4 (E2M1, 1x16 blocks of E4M3 scales) peak; None: no block-scaled tensor cores
    # (Hopper), so neither MXFP8 nor NVFP4 GEMMs have a rate. NVFP4 kernels run their main loop at
    # `nvfp4_efficiency` of it: TE's pre-quantized B300 layer (3.764 ms vs 6.812 FP8 current, 1.81x
    # where the peaks give 2x) puts it at 0.9.
    fp4_tflops: float | None = None
    nvfp4_efficiency: float = 0.9

    def gemm_us(self, m: int, n: int, k: int, batch: int, tflops: float, operand_bytes: float) -> float:
        """One GEMM (left m x k, right k x n, `batch` of them) at `tflops` dense peak, its main loop at
        `bf16_efficiency` of it for 2-byte operands, `gemm_efficiency` for narrower ones."""
        efficiency = self.gemm_efficiency
        if operand_bytes >= HIGH_BYTES and self.bf16_efficiency is not None:
            efficiency = self.bf16_efficiency
        tiles = max(1, batch * math.ceil(m / TILE) * math.ceil(n / TILE))
        splits = max(1, min(self.sms // tiles, k // SPLIT_K_MIN)) if tiles < self.sms else 1
        waves = math.ceil(tiles * splits / self.sms)
        sm_flops_per_us = tflops * 1e6 * efficiency / self.sms
        compute = waves * (2 * TILE * TILE * math.ceil(k / splits) / sm_flops_per_us + self.tile_overhead_us)
        memory = self.stream_us(batch * ((m * k + k * n) * operand_bytes + m * n * HIGH_BYTES))
        return self.launch_us + max(compute, memory)

    def stream_us(self, nbytes: float) -> float:
        """Moving `nbytes` through HBM at the achievable bandwidth."""
        return nbytes / (self.hbm_tbps * 1e6 * self.memory_efficiency)

    def pass_us(self, nbytes: float) -> float:
        """One amax, cast or transpose kernel moving `nbytes`."""
        return self.launch_us + nbytes / (self.hbm_tbps * 1e6 * self.cast_efficiency)


# Dense peaks and bandwidths from NVIDIA's datasheets (the sparse figures halved), as remembered:
# no datasheet was at hand when the Blackwell rows were added, so those are the figures as best
# known, cross-checked only against what the published kernel times imply. H100 Tensor Core GPU
# datasheet (SXM5 and PCIe columns), H200 datasheet (SXM), H800 SXM5 product sheet (H100 SXM
# compute, 3.35 TB/s); SM counts from the Hopper whitepaper (132 SXM, 114 PCIe).
# Blackwell: HGX B200 datasheet (1,000 W: 4.5 PFLOP/s FP8, 2.25 BF16, 9 FP4, 7.7 TB/s); HGX B300
# (4.5 FP8, 2.25 BF16, 8 TB/s); GB200 NVL72 per GPU (1,200 W: 5 FP8, 2.5 BF16, 10 FP4, 8 TB/s);
# 148 SMs on each (B300's count is assumed equal to B200's). FP4 is twice FP8 on B200 and GB200.
# B300 (Blackwell Ultra) is advertised with a higher dense FP4 peak (about 1.5x B200's); the
# published TE NVFP4 GEMM times on B300 (PUBLISHED.md A: 5.1 PFLOP/s over a pre-quantized layer)
# fit twice FP8 at the FP8 kernels' fraction of peak, not the higher figure, so B300 keeps 2x.
# Hopper's rates are what fp8fx runs there, measured (docs/results.md, "On a GPU"): the Llama step
# of the "Third run" (H200) spends 35.0 ms in its 45 BF16 GEMMs (aten::mm; 28.0 TFLOP, 800
# TFLOP/s) and 19.2 ms in the same GEMMs on cuBLAS FP8 (`_scaled_mm`, tensorwise; the "Second run"
# H100 profile: 19.3 ms), which the tile model meets at main loops of 0.85 and 0.80 of the peaks.
# Rowwise (cuBLAS's row-scaled `_scaled_mm`): its step is 6.6 ms (H200, third run) and 7.6 ms (H100,
# "Fifth run") longer than tensorwise; less its passes, its GEMMs run at 0.78 of tensorwise's rate.
# Those steps also stored the fp32 product of each rowwise cast of a recomputed gradient (fixed
# since, `fp8fx.compiler.lowering._scaled`), time this rate absorbs: to be set again from a GPU run.
# The H200's AdamW step took 9.24-9.40 ms over 1.41 GB of BF16 parameters (third run's profile):
# 0.66 of its bandwidth; on the H100 the steps fit the default 0.85 (torch's foreach kernels do not
# keep up with the H200's faster memory).
_HOPPER = dict(bf16_efficiency=0.85, gemm_efficiency=0.80, rowwise_efficiency=0.78)
_H100_SXM = GpuSpec("h100-sxm", fp8_tflops=1979, bf16_tflops=989, hbm_tbps=3.35, sms=132, **_HOPPER)
TARGETS: dict[str, GpuSpec] = {
    "h100": _H100_SXM,
    "h100-sxm": _H100_SXM,
    "h100-pcie": GpuSpec("h100-pcie", fp8_tflops=1513, bf16_tflops=756, hbm_tbps=2.0, sms=114, **_HOPPER),
    "h200": GpuSpec("h200", fp8_tflops=1979, bf16_tflops=989, hbm_tbps=4.8, sms=132, optimizer_efficiency=0.66, **_HOPPER),
    "h800": GpuSpec("h800", fp8_tflops=1979, bf16_tflops=989, hbm_tbps=3.35, sms=132, **_HOPPER),
    "b200": GpuSpec("b200", fp8_tflops=4500, bf16_tflops=2250, hbm_tbps=7.7, sms=148, fp8_transposes=False, fp4_tflops=9000),
    "b300": GpuSpec("b300", fp8_tflops=4500, bf16_tflops=2250, hbm_tbps=8.0, sms=148, fp8_transposes=False, fp4_tflops=9000),
    "gb200": GpuSpec("gb200", fp8_tflops=5000, bf16_tflops=2500, hbm_tbps=8.0, sms=148, fp8_transposes=False, fp4_tflops=10000),
}

_SPEC_KEYS = {"fp8": "fp8_tflops", "bf16": "bf16_tflops", "bw": "hbm_tbps", "sms": "sms"}
_OPTIONAL_KEYS = {"fp4": "fp4_tflops"}  # a dense FP4 peak: a Blackwell-class GPU (block-scaled, either-major FP8)
_SPEC_FORM = "fp8=TFLOPS,bf16=TFLOPS,bw=TB/s,sms=N[,fp4=TFLOPS][,name=NAME]"


def gpu(spec: str) -> GpuSpec:
    """A target by name (case-insensitive, see `TARGETS`) or a spec like
    "fp8=1979,bf16=989,bw=3.35,sms=132,name=mygpu" (dense TFLOP/s, TB/s, SM count). With an `fp4`
    peak the GPU is taken as Blackwell-class: block-scaled MXFP8/NVFP4 GEMMs, FP8 read in either major."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{what}; known targets: {', '.join(TARGETS)}, or a spec {_SPEC_FORM}")

    text = spec.strip()
    if "=" not in text:
        if text.lower() not in TARGETS:
            raise bad(f"unknown GPU target {spec!r}")
        return TARGETS[text.lower()]
    name, numbers = "custom", {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        key = key.lower()
        fields = {**_SPEC_KEYS, **_OPTIONAL_KEYS}
        if not sep or key not in (*fields, "name") or fields.get(key) in numbers:
            raise bad(f"GPU spec {spec!r}: bad part {part.strip()!r} (keys fp8, bf16, bw, sms, fp4, name, each at most once)")
        if key == "name":
            name = value or name
            continue
        try:
            number = int(value) if key == "sms" else float(value)
        except ValueError:
            number = 0
        if not 0 < number < math.inf:
            raise bad(f"GPU spec {spec!r}: {key}={value!r} is not a positive {'integer' if key == 'sms' else 'number'}")
        numbers[fields[key]] = number
    missing = [key for key, field in _SPEC_KEYS.items() if field not in numbers]
    if missing:
        raise bad(f"GPU spec {spec!r}: missing {', '.join(missing)}")
    return GpuSpec(name, **numbers, fp8_transposes="fp4_tflops" not in numbers)


@dataclass(frozen=True)
class Prediction:
    bf16_us: float  # this GEMM in BF16
    fp8_us: float  # as decided: the FP8 GEMM plus the passes its casts add; bf16_us for a GEMM kept high
    passes_us: float  # the amax / cast / transpose part of fp8_us

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us


# (GEMM role, operand role) pairs that read a transposed FP8 copy under tensorwise scaling.
_TRANSPOSED = {("grad_input", "weight"), ("grad_weight", "grad_output"), ("grad_weight", "input")}
# The GEMM that casts (and owns) each operand's shared tensorwise FP8 copy.
_CAST_ON = {"input": "output", "weight": "output", "grad_output": "grad_input"}


# Bytes a cast writes per element: the low-precision element and its share of the scales (MXFP8:
# one E8M0 byte per 32 elements; NVFP4: half a byte, one E4M3 byte per 16).
_CAST_WRITE = {"fp8": 1.0, "mx": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def _is_nvfp4(op: OpRecord) -> bool:
    return op.formats is not None and "nvfp4" in op.formats


def _passes_us(op: OpRecord, gpu: GpuSpec, numels: tuple[int, int]) -> float:
    kind = "nvfp4" if _is_nvfp4(op) else "mx" if op.granularity == "mx" else "fp8"

    def cast(numel: int) -> float:
        # An amax pass first where the scale needs the whole tensor's amax: dynamic FP8 scaling, and
        # NVFP4's per-tensor second-level scale. MXFP8's block amax is taken inside the cast, and
        # delayed scaling takes the amax inside the cast. Then read BF16 and write the cast.
        whole_amax = kind == "nvfp4" or (kind == "fp8" and op.scaling != "delayed")
        amax = gpu.pass_us(HIGH_BYTES * numel) if whole_amax else 0.0
        return amax + gpu.pass_us((HIGH_BYTES + _CAST_WRITE[kind]) * numel)

    total = 0.0
    for operand, numel in zip(op.operands, numels):
        if op.graph_kind == "inference" and operand == "weight":
            continue  # quantized once when the model is converted, not per call
        if op.granularity != "tensorwise":  # every GEMM casts its own operands
            total += cast(numel)
        elif gpu.fp8_transposes and (op.role, operand) in _TRANSPOSED:
            total += gpu.pass_us(2 * numel)  # read the FP8 copy, write it transposed
        elif _CAST_ON.get(operand, op.role) == op.role:
            total += cast(numel)
    return total


def _counted_passes_us(passes: int, gpu: GpuSpec, numels: tuple[int, int]) -> float:
    """The passes the report counted for a GEMM (`OpRecord.memory_passes_added`: reads and writes of
    an operand-sized tensor by the kernels its amaxes, casts and copies run in), each moving
    `PASS_BYTES` an element of the mean of its two operands at `memory_efficiency` of bandwidth,
    in one kernel per two passes (a kernel reads one tensor and writes another): a small GEMM's
    casts cost their launches, as its amax must finish before its cast can start."""
    if not passes:
        return 0.0
    nbytes = passes * PASS_BYTES * sum(numels) / len(numels)
    return math.ceil(passes / 2) * gpu.launch_us + gpu.stream_us(nbytes)


def _main_loop(op: OpRecord, gpu: GpuSpec) -> tuple[float, float]:
    """The peak an FP8/FP4 GEMM's main loop runs at (TFLOP/s) and its operands' bytes an element."""
    if _is_nvfp4(op):
        if op.formats != ("nvfp4", "nvfp4"):
            raise ValueError(
                f"fp8fx cost model: no rate for a GEMM of {op.formats[0]} x {op.formats[1]} operands ({op.site}.{op.role})"
            )
        _block_scaled(op, gpu, "NVFP4")
        return gpu.fp4_tflops * gpu.nvfp4_efficiency, 0.5
    rates = {"tensorwise": 1.0, "rowwise": gpu.rowwise_efficiency, "blockwise": gpu.blockwise_efficiency, "mx": gpu.mx_efficiency}
    if op.granularity not in rates:
        raise ValueError(f"fp8fx cost model: no main-loop rate for {op.granularity} FP8 GEMMs ({op.site}.{op.role})")
    if op.granularity == "mx":
        _block_scaled(op, gpu, "MXFP8")
    return gpu.fp8_tflops * rates[op.granularity], 1.0


def _block_scaled(op: OpRecord, gpu: GpuSpec, what: str) -> None:
    if gpu.fp4_tflops is None:
        raise ValueError(
            f"fp8fx cost model: {gpu.name} has no block-scaled (MXFP8/NVFP4) tensor cores, no rate for {what} GEMMs "
            f"({op.site}.{op.role}); "
            "give the target an fp4 peak"
        )


def _cost(op: OpRecord) -> str:
    return BY_KIND[op.op].cost if op.op in BY_KIND else "gemm"


def predict(op: OpRecord, gpu: GpuSpec) -> Prediction | None:
    """Predicted time of one GEMM on `gpu` in BF16 and as decided; None when a dimension is dynamic.
    A GEMM in FP8 is one of `precision` "fp8": tensorwise, rowwise, blockwise or MXFP8 (granularity
    "mx"), or NVFP4 when its `formats` are ("nvfp4", "nvfp4")."""
    dims = (op.m, op.n, op.k, op.batch)
    if not all(isinstance(d, int) for d in dims):
        return None
    m, n, k, batch = dims
    cost = _cost(op)
    if cost == "grouped_gemm" and isinstance(op.groups, int) and op.groups > 1:  # G GEMMs: rows (K for grad_weight) split evenly
        batch = op.groups
        m, k = (m, math.ceil(k / batch)) if op.role == "grad_weight" else (math.ceil(m / batch), k)
    if cost == "fused_attention":  # one fused kernel: its counted FLOPs, scores never stored
        bf16 = gpu.launch_us + op.flops / (gpu.bf16_tflops * 1e6 * gpu.attention_efficiency)
        return Prediction(bf16, bf16, 0.0)
    if cost == "implicit_gemm" and batch > 1:  # grouped: `batch` tiny GEMMs in one memory-bound kernel, not waves of tiles each
        compute = op.flops / (gpu.bf16_tflops * 1e6 * gpu.gemm_efficiency)
        bf16 = gpu.launch_us + max(compute, gpu.stream_us(batch * (m * k + k * n + m * n) * HIGH_BYTES))
        return Prediction(bf16, bf16, 0.0)
    bf16 = gpu.gemm_us(m, n, k, batch, gpu.bf16_tflops, HIGH_BYTES)
    if op.precision != "fp8":
        return Prediction(bf16, bf16, 0.0)
    tflops, operand_bytes = _main_loop(op, gpu)
    gemm = gpu.gemm_us(m, n, k, batch, tflops, operand_bytes)
    numels = (batch * m * k, batch * k * n)
    passes = (
        _passes_us(op, gpu, numels) if op.memory_passes_added is None else _counted_passes_us(op.memory_passes_added, gpu, numels)
    )
    return Prediction(bf16, gemm + passes, passes)


def optimizer_us(param_bytes: int, gpu: GpuSpec) -> float:
    """torch's AdamW step (foreach, the default on a GPU) over `param_bytes` of parameters: its kernels
    (weight decay; lerp into exp_avg; mul and addcmul into exp_avg_sq; sqrt, div and add for the
    denominator; addcdiv into the parameter) read or write 21 parameter-sized tensors of the
    parameters' dtype (gradients and both moments share it), at `optimizer_efficiency` of bandwidth."""
    return OPTIMIZER_PASSES * param_bytes / (gpu.hbm_tbps * 1e6 * gpu.optimizer_efficiency) if param_bytes else 0.0


@dataclass(frozen=True)
class StepPrediction:
    bf16_us: float  # the whole step in BF16: GEMMs, attention, optimizer, other
    fp8_us: float  # as decided
    gemm_bf16_us: float
    gemm_fp8_us: float  # FP8 GEMMs with their passes, and the GEMMs kept high
    other_us: float  # non-GEMM ops, memory-bound, the same in both
    attention_us: float = 0.0  # fused attention (SDPA), forward and backward, the same in both
    optimizer_us: float = 0.0  # the optimizer step over every parameter, the same in both

    @property
    def speedup(self) -> float:
        return self.bf16_us / self.fp8_us if self.fp8_us else 1.0  # an empty step: nothing to gain

    @property
    def gemm_speedup(self) -> float:
        return self.gemm_bf16_us / self.gemm_fp8_us if self.gemm_fp8_us else 1.0


def predict_step(ops: list[OpRecord], non_gemm_bytes: int, gpu: GpuSpec, param_bytes: int = 0) -> StepPrediction:
    """A step of `ops` (GEMMs with dynamic dimensions left out) plus `non_gemm_bytes` moved by the
    other ops (`sum(Report.non_gemm_bytes.values())`) and, for a training step, an AdamW step over
    `param_bytes` of trainable parameters (`Report.param_bytes`; 0: no optimizer)."""
    timed = [(op, p) for op, p in ((op, predict(op, gpu)) for op in ops) if p is not None]
    attention = sum(p.bf16_us for op, p in timed if _cost(op) == "fused_attention")
    gemms = [p for op, p in timed if _cost(op) != "fused_attention"]
    gemm_bf16, gemm_fp8 = sum(p.bf16_us for p in gemms), sum(p.fp8_us for p in gemms)
    other, optimizer = gpu.stream_us(non_gemm_bytes), optimizer_us(param_bytes, gpu)
    same = other + attention + optimizer
    return StepPrediction(gemm_bf16 + same, gemm_fp8 + same, gemm_bf16, gemm_fp8, other, attention, optimizer)
