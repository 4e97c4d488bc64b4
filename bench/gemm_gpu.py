"""FP8 GEMM and transformer-block throughput on an NVIDIA GPU (H100/H200/B200/Ada).

fp8fx's generated Triton kernel vs torch._scaled_mm vs BF16 torch.mm, and a GPT block compiled with
fp8fx vs plain Inductor.

Run: python bench/gemm_gpu.py [--sizes 1024 4096] [--seqs 2048 4096] [--no-backward] [--json out.json]

1. GEMMs: square sizes, and the four linear layers of a GPT-3 1.3B / 6.7B / 13B block (QKV,
   attention out, MLP up, MLP down) at each sequence length, with their backward GEMMs (dgrad:
   [M,N] @ [N,K]; wgrad: [N,M] @ [M,K]). Columns in TFLOP/s (2*M*N*K / median time of warm runs,
   triton.testing.do_bench), each FP8 one with its speedup over BF16: fp8fx tensorwise and rowwise
   (fp8fx.codegen.launch.fp8_gemm), fp8fx tensorwise including the quantization of the left
   operand (the right one, the weight, pre-quantized), torch._scaled_mm tensorwise and rowwise.
   Operands are E4M3, the left row-major and the right column-major; output BF16.
2. Block: a pre-norm GPT block (LayerNorm, causal SDPA attention, GELU MLP) in BF16, forward +
   backward, compiled with fp8fx.backend(inner="inductor") vs plain torch.compile.
Needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer); exits with code 2 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import fp8fx
from fp8fx.codegen.launch import fp8_gemm, quantize

E4M3 = torch.float8_e4m3fn
MODELS = {"gpt3-1.3b": 2048, "gpt3-6.7b": 4096, "gpt3-13b": 5120}  # hidden size
COLUMNS = ("bf16", "fp8fx", "fp8fx_rowwise", "fp8fx_incl_quantize", "scaled_mm", "scaled_mm_rowwise")
HEADERS = ("bf16 mm", "fp8fx tw", "fp8fx rw", "fp8fx tw+quant", "_scaled_mm tw", "_scaled_mm rw")


def gemm_shapes(args) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of every GEMM to measure: out[M, N] = a[M, K] @ b[K, N]."""
    shapes = [(f"square {s}", s, s, s) for s in args.sizes]
    for model, h in MODELS.items():
        for seq in args.seqs:
            m = seq * args.batch
            for layer, k, n in (("qkv", h, 3 * h), ("attn_out", h, h), ("mlp_up", h, 4 * h), ("mlp_down", 4 * h, h)):
                name = f"{model} s{seq} {layer}"
                shapes.append((name, m, n, k))
                if not args.no_backward:
                    shapes.append((f"{name}.dgrad", m, k, n))  # grad_input = grad_out[M,N] @ w[N,K]
                    shapes.append((f"{name}.wgrad", n, k, m))  # grad_weight = grad_out^T[N,M] @ x[M,K]
    return shapes


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def bench_ms(fn, args) -> float:
    fn()  # autotune / first-call costs outside the timing
    torch.cuda.synchronize()
    return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def measure_gemm(m: int, n: int, k: int, args, errors: dict) -> dict:
    """TFLOP/s of each column for one shape (None where a kernel failed), and fp8fx's deviation."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # activation, [M, K]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # weight, [N, K]; b = w.t() is [K, N] column-major
    a, s_a = quantize(x, E4M3, ())
    w8, s_w = quantize(w, E4M3, ())
    b, sinv_a, sinv_b = w8.t(), s_a.reciprocal(), s_w.reciprocal()
    a_rw, s_a_rw = quantize(x, E4M3, (1, 0))  # scales [M, 1]
    w8_rw, s_w_rw = quantize(w, E4M3, (1, 0))  # scales [N, 1]
    b_rw, sinv_a_rw, sinv_b_rw = w8_rw.t(), s_a_rw.reciprocal().contiguous(), s_w_rw.reciprocal().t().contiguous()  # [1, N]
    wt = w.t()

    def incl_quantize():
        q, s = quantize(x, E4M3, ())
        return fp8_gemm(q, b, s.reciprocal(), sinv_b, out_dtype=torch.bfloat16)

    fns = {
        "bf16": lambda: torch.mm(x, wt),
        "fp8fx": lambda: fp8_gemm(a, b, sinv_a, sinv_b, out_dtype=torch.bfloat16),
        "fp8fx_rowwise": lambda: fp8_gemm(
            a_rw, b_rw, sinv_a_rw, sinv_b_rw, block_a=(1, 0), block_b=(0, 1), out_dtype=torch.bfloat16
        ),
        "fp8fx_incl_quantize": incl_quantize,
        "scaled_mm": lambda: torch._scaled_mm(a, b, scale_a=sinv_a, scale_b=sinv_b, out_dtype=torch.bfloat16),
        "scaled_mm_rowwise": lambda: torch._scaled_mm(a_rw, b_rw, scale_a=sinv_a_rw, scale_b=sinv_b_rw, out_dtype=torch.bfloat16),
    }
    row = {}
    for col, fn in fns.items():
        try:
            row[col] = tflops(m, n, k, bench_ms(fn, args))
        except Exception as e:  # noqa: BLE001 - one failing kernel should not stop the table
            row[col] = None
            if col not in errors:
                errors[col] = f"{type(e).__name__}: {e}"
                print(f"{col} failed (shown as '-'): {errors[col]}", file=sys.stderr)
    try:  # the same quantized operands through both kernels: they should agree to rounding
        ours, ref = fns["fp8fx"]()[0].float(), fns["scaled_mm"]().float()
        row["fp8fx_vs_scaled_mm_rel_err"] = ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    except Exception:  # noqa: BLE001 - already reported above
        row["fp8fx_vs_scaled_mm_rel_err"] = None
    return row


def run_gemms(args) -> list[dict]:
    print(f"{'GEMM':32s} {'M':>6s} {'N':>6s} {'K':>6s}  " + "  ".join(f"{h:>15s}" for h in HEADERS))
    print(f"{'':53s}TFLOP/s; FP8 columns: TFLOP/s and speedup over bf16 mm")
    results, cache, errors = [], {}, {}
    for name, m, n, k in gemm_shapes(args):
        if (m, n, k) not in cache:
            cache[(m, n, k)] = measure_gemm(m, n, k, args, errors)
        row = cache[(m, n, k)]
        bf = row["bf16"]
        cells = []
        for col in COLUMNS:
            tf = row[col]
            if tf is None:
                cells.append(f"{'-':>15s}")
            elif col == "bf16" or not bf:
                cells.append(f"{tf:15.1f}")
            else:
                cells.append(f"{tf:8.1f} {tf / bf:5.2f}x")
        err = row["fp8fx_vs_scaled_mm_rel_err"]
        flag = f"  ! fp8fx vs _scaled_mm rel. error {err:.1e}" if err is not None and err > 1e-2 else ""
        print(f"{name:32s} {m:6d} {n:6d} {k:6d}  " + "  ".join(cells) + flag, flush=True)
        results.append(dict(name=name, M=m, N=n, K=k, tflops={c: row[c] for c in COLUMNS},
                            speedup_over_bf16={c: row[c] / bf if row[c] and bf else None for c in COLUMNS[1:]},
                            fp8fx_vs_scaled_mm_rel_err=err))  # fmt: skip
    return results


class GPTBlock(nn.Module):
    """Pre-norm GPT block: x + attn(ln1(x)), then + mlp(ln2(x)); causal attention through SDPA."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.attn_out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp_up, self.mlp_down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_down(F.gelu(self.mlp_up(self.ln2(x))))


def run_block(args) -> dict:
    h, heads = args.block_hidden, args.block_heads or max(1, args.block_hidden // 128)
    torch.manual_seed(0)
    base = GPTBlock(h, heads).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.block_batch, args.block_seq, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    print(f"\nGPT block fwd+bwd: hidden {h}, {heads} heads, batch {args.block_batch} x seq {args.block_seq}, bf16 params")
    out = dict(hidden=h, heads=heads, batch=args.block_batch, seq=args.block_seq)
    for name, make in (
        ("bf16_inductor", lambda blk: torch.compile(blk)),
        ("fp8fx_inductor", lambda blk: torch.compile(blk, backend=fp8fx.backend(policy=args.policy, inner="inductor"))),
    ):
        block = copy.deepcopy(base)
        compiled = make(block)
        def step():
            compiled(x).backward(dy)

        for _ in range(3):  # compile, then settle autotuning
            step()
        torch.cuda.synchronize()
        grads = [x, *block.parameters()]  # reset between runs, so each one writes (not accumulates) its gradients
        out[f"{name}_ms"] = do_bench(step, warmup=args.warmup, rep=args.rep, grad_to_none=grads, return_mode="median")
        print(f"  {name:15s} {out[f'{name}_ms']:8.2f} ms")
        if name.startswith("fp8fx"):
            summary = fp8fx.report(compiled).summary()
            out["fp8fx_report"] = summary
            fwd, bwd = summary["fp8_flop_share_forward"] or 0, summary["fp8_flop_share_backward"] or 0
            n_fp8, n_all = summary["fp8_gemms"], summary["gemms"]
            print(f"  fp8fx: {n_fp8}/{n_all} GEMMs in FP8; FP8 FLOP share forward {fwd:.0%}, backward {bwd:.0%}")
    out["speedup"] = out["bf16_inductor_ms"] / out["fp8fx_inductor_ms"]
    print(f"  speedup fp8fx over bf16: {out['speedup']:.2f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], help="square GEMM sizes")
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096], help="sequence lengths of the GPT-3 shapes")
    ap.add_argument("--batch", type=int, default=1, help="batch of the GPT-3 shapes (M = batch * seq)")
    ap.add_argument("--no-backward", action="store_true", help="skip the dgrad/wgrad GEMMs of the GPT-3 shapes")
    ap.add_argument("--no-gemms", action="store_true", help="skip the GEMM table")
    ap.add_argument("--no-block", action="store_true", help="skip the transformer-block benchmark")
    ap.add_argument("--block-hidden", type=int, default=4096)
    ap.add_argument("--block-heads", type=int, default=0, help="attention heads (default: hidden / 128)")
    ap.add_argument("--block-seq", type=int, default=2048)
    ap.add_argument("--block-batch", type=int, default=1)
    ap.add_argument("--policy", default=None, help="fp8fx policy YAML for the block (default: built-in tensorwise)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time in ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench measuring time in ms")
    ap.add_argument("--json", metavar="FILE", help="write all results to FILE as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemm_gpu.py: no CUDA GPU found (torch.cuda.is_available() is False); needs an NVIDIA GPU, sm_89+", file=sys.stderr)
        sys.exit(2)
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        name = torch.cuda.get_device_name()
        print(f"gemm_gpu.py: {name} (sm_{cap[0]}{cap[1]}) has no FP8 tensor cores; needs sm_89+", file=sys.stderr)
        sys.exit(2)
    env = dict(gpu=torch.cuda.get_device_name(), capability=f"{cap[0]}.{cap[1]}", torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda, fp8fx=fp8fx.__version__)  # fmt: skip
    print(f"GPU {env['gpu']} (sm_{cap[0]}{cap[1]}), torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
          f"fp8fx {env['fp8fx']}\n")  # fmt: skip
    results = dict(env=env, args=vars(args))
    if not args.no_gemms:
        results["gemms"] = run_gemms(args)
    if not args.no_block:
        results["block"] = run_block(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
