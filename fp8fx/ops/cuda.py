"""The GPU implementations of the fp8fx ops, registered on them here.

`fp8fx::fp8_gemm` runs the kernel the graph chose (`fp8fx.codegen.dispatch.choose_kernel`):
"triton", the generated kernel through its one launcher (`fp8fx.codegen.launch`), or "scaled_mm",
`torch._scaled_mm` (cuBLASLt / CUTLASS) to fp32 and then the epilogue as torch ops (the
reference's). `fp8fx::cast` runs the generated cast kernel, `fp8fx::scaled_mm` (batched GEMMs, and
graphs without fused epilogues) `torch._scaled_mm`.

The code a GPU runs is the code the CPU tests run: on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1` before fp8fx is imported) a "triton" GEMM goes through `fp8_gemm_triton` too,
and `scaled_mm_2d` runs on torch's CPU `_scaled_mm` kernel.

`torch._scaled_mm` takes 2-D operands whose dimensions are multiples of 16, the left operand
row-major and the right one column-major, and at most one E5M2 operand. Any other shape or layout
is zero-padded and copied here (zeros add nothing to the product): the token dimension varies from
batch to batch, and it is K in the weight gradient. Rowwise and blockwise scaling produce bf16 in
the kernel; the result is then cast to the requested dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fp8fx.codegen.dispatch import grouped_launcher, scaled_mm_kind
from fp8fx.codegen.variants import nvfp4_blocks
from fp8fx.codegen.versions import interpreter_active, triton_available
from fp8fx.core import grouped
from fp8fx.core.epilogue import Epilogue
from fp8fx.core.formats import FP8_DTYPES, fp8_format_of
from fp8fx.ops import library, reference
from fp8fx.ops.args import Fp8GemmArgs

ALIGN = 16
NO_EPILOGUE = Epilogue()


def _pad_to(t: Tensor, dim: int, multiple: int, value: float = 0.0) -> Tensor:
    extra = -t.shape[dim] % multiple
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # F.pad has no FP8 kernels: pad the bytes
        return F.pad(t.view(torch.uint8), pad).view(t.dtype)
    return F.pad(t, pad, value=value)


def _block_recipe(block: list[int]):
    if block == [1, 128] or block == [128, 1]:
        return F.ScalingType.BlockWise1x128
    if block == [128, 128]:
        return F.ScalingType.BlockWise128x128
    raise ValueError(f"FP8 GEMM on CUDA: no kernel for block {block}; supported: [1,128], [128,1], [128,128]")


def scaled_mm_2d(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    out_dtype: torch.dtype,
    block_a: list[int] = (),
    block_b: list[int] = (),
    fast_accum: bool = False,
) -> Tensor:
    """One 2-D FP8 GEMM through `torch._scaled_mm`: checks, pads M, N and K to multiples of 16, lays
    out b column-major. `fast_accum` is its `use_fast_accum` (Hopper's FP8 accumulator, unpromoted).
    Scale blocks it cannot take (MX's, as fp32 scale inverses) run the generated kernel instead, and
    NVFP4's FP4 operands the generated NVFP4 kernel."""
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("FP8 GEMM with two E5M2 operands is not supported by cuBLASLt; use format hybrid or e4m3")
    m, n = a.shape[0], b.shape[1]
    block_a, block_b = list(block_a), list(block_b)
    if nvfp4_blocks(block_a, block_b):  # FP4 operands: the generated NVFP4 kernel (Blackwell)
        if not triton_available():
            raise RuntimeError("fp8fx: NVFP4 GEMMs run in a generated Triton kernel; install Triton (Linux)")
        from fp8fx.codegen.launch import nvfp4_gemm

        return nvfp4_gemm(a, b, scale_inv_a, scale_inv_b, block_a=tuple(block_a), block_b=tuple(block_b), out_dtype=out_dtype)
    if scaled_mm_kind(block_a, block_b) is None and triton_available():  # MX blocks: the generated kernel
        from fp8fx.codegen.launch import fp8_gemm

        return fp8_gemm(a, b, scale_inv_a, scale_inv_b, block_a=tuple(block_a), block_b=tuple(block_b), out_dtype=out_dtype)[0]
    # Zero rows / columns / K-slices change no product, and padding to 16 never opens a new 128-block.
    a = _pad_to(_pad_to(a, 0, ALIGN), 1, ALIGN).contiguous()
    b = _pad_to(_pad_to(b, 0, ALIGN), 1, ALIGN).t().contiguous().t()  # column-major
    kind = scaled_mm_kind(block_a, block_b)
    if kind == "tensorwise":
        out = torch._scaled_mm(a, b, scale_a=scale_inv_a, scale_b=scale_inv_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
        return _unpadded(out, m, n, out_dtype)
    if kind == "rowwise":  # a tensorwise side becomes a constant column / row of scales
        sa = _pad_to(scale_inv_a.reshape(-1, 1).expand(m, 1).contiguous(), 0, ALIGN, 1.0)
        sb = _pad_to(scale_inv_b.reshape(1, -1).expand(1, n).contiguous(), 1, ALIGN, 1.0)
        out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
        return _unpadded(out, m, n, out_dtype)
    sa, sb = blockwise_scales(scale_inv_a, scale_inv_b, block_a, block_b)
    out = F.scaled_mm(
        a, b, sa, _block_recipe(block_a), sb, _block_recipe(block_b), output_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )
    return _unpadded(out, m, n, out_dtype)


def _unpadded(out: Tensor, m: int, n: int, out_dtype: torch.dtype) -> Tensor:
    """The [m, n] product of a padded GEMM's result, contiguous (as the ops' fakes say) and in `out_dtype`."""
    return out[:m, :n].to(out_dtype).contiguous()


def _k_major(scale: Tensor, k_blocks: int) -> Tensor:
    """[lines, K-blocks] scales as [round_up(K-blocks, 4), lines] with K-blocks innermost (strides
    (1, round_up(K-blocks, 4))): cuBLAS's layout for 128x128 blocks; the padding blocks are 1."""
    lines = scale.shape[0]
    out = scale.new_ones(lines, -(-k_blocks // 4) * 4)
    out[:, :k_blocks] = scale
    return out.t()


def blockwise_scales(scale_inv_a: Tensor, scale_inv_b: Tensor, block_a: list[int], block_b: list[int]) -> tuple[Tensor, Tensor]:
    """fp8fx's blockwise scale inverses ([M or M/128, K/128] for a, [K/128, N or N/128] for b) in
    the layouts `torch._scaled_mm`'s blockwise GEMMs (cuBLASLt, Hopper) check, torch 2.11 to 2.13
    alike; rows (columns) of per-line scales padded to 16 with 1s, as the operands are with zeros:
    1x128: [M, K/128] with strides (1, M) (M-major), b's [N, K/128] with strides (1, N);
    128x128: [round_up(K/128, 4), M/128] with strides (1, round_up(K/128, 4)) (K-major), b's alike."""
    k_blocks = scale_inv_a.shape[1]
    if block_a == [1, 128]:
        sa = _pad_to(scale_inv_a, 0, ALIGN, 1.0).t().contiguous().t()
    else:
        sa = _k_major(scale_inv_a, k_blocks)
    if block_b == [128, 1]:
        sb = _pad_to(scale_inv_b, 1, ALIGN, 1.0).contiguous().t()
    else:
        sb = _k_major(scale_inv_b.t(), k_blocks)
    return sa, sb


def scaled_mm_cuda(
    a: Tensor,
    b: Tensor,
    scale_inv_a: Tensor,
    scale_inv_b: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    block_a: list[int],
    block_b: list[int],
    fast_accum: bool = False,
) -> Tensor:
    """`fp8fx::scaled_mm` on CUDA: 2-D and batched GEMMs (one `torch._scaled_mm` per batch entry)."""
    reference.check_scaled_mm_args(a, b, scale_inv_a, scale_inv_b, block_a, block_b)
    if a.dim() == 2:
        out = scaled_mm_2d(a, b, scale_inv_a, scale_inv_b, out_dtype, block_a, block_b, fast_accum)
    else:  # bmm: one GEMM per batch entry until the batched Triton kernel exists

        def scale(s: Tensor, block: list[int], i: int) -> Tensor:
            return s[i] if block else s

        out = torch.stack(
            [
                scaled_mm_2d(
                    a[i],
                    b[i],
                    scale(scale_inv_a, block_a, i),
                    scale(scale_inv_b, block_b, i),
                    out_dtype,
                    block_a,
                    block_b,
                    fast_accum,
                )
                for i in range(a.shape[0])
            ]
        )
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out


def fp8_gemm_triton(g: Fp8GemmArgs, ep: Epilogue):
    """The generated kernel, through the launcher every device uses (GPUs, and the interpreter)."""
    from fp8fx.codegen.launch import fp8_gemm

    out, aux, amax = fp8_gemm(
        g.a,
        g.b,
        g.scale_inv_a,
        g.scale_inv_b,
        block_a=tuple(g.block_a),
        block_b=tuple(g.block_b),
        epilogue=ep,
        bias=g.bias,
        other=g.other,
        residual=g.residual,
        out_scale=g.out_scale,
        out_dtype=g.out_dtype,
        aux_dtype=g.aux_dtype,
        fast_accum=g.fast_accum,
    )
    # Absent outputs are fresh empty tensors (outputs of a custom op may not alias each other).
    aux = aux if aux is not None else out.new_empty(0, dtype=g.aux_dtype)
    return out, aux, amax if amax is not None else out.new_empty(0, dtype=torch.float32)


def fp8_gemm_on_cuda(g: Fp8GemmArgs):
    """`fp8fx::fp8_gemm` on CUDA: the kernel the graph chose."""
    ep = Epilogue.parse(g.epilogue)
    if g.gpu_kernel in ("scaled_mm", "nvfp4"):  # cuBLASLt's (NVFP4: the FP4 kernel's) GEMM, then the epilogue as torch ops
        if ep == NO_EPILOGUE and g.out_dtype not in FP8_DTYPES:  # cuBLAS writes the output: no fp32 product to convert
            out = scaled_mm_2d(g.a, g.b, g.scale_inv_a, g.scale_inv_b, g.out_dtype, g.block_a, g.block_b, fast_accum=g.fast_accum)
            return out, out.new_empty(0, dtype=g.aux_dtype), out.new_empty(0, dtype=torch.float32)
        y = scaled_mm_2d(g.a, g.b, g.scale_inv_a, g.scale_inv_b, torch.float32, g.block_a, g.block_b, fast_accum=g.fast_accum)
        return reference.fp8_gemm_epilogue_after(y, g.bias, g.other, g.residual, g.out_scale, g.out_dtype, g.aux_dtype, ep)
    return fp8_gemm_triton(g, ep)


def fp8_gemm_cuda(*args, **kwargs):
    """The op's CUDA kernel: `fp8_gemm_on_cuda` on its call's arguments."""
    return fp8_gemm_on_cuda(Fp8GemmArgs.bind(args, kwargs))


def fp8_gemm_cpu(*args, **kwargs):
    """`fp8fx::fp8_gemm` on CPU tensors: a "triton" or "nvfp4" GEMM under Triton's interpreter runs
    the generated kernel as a GPU would; everything else the exact emulation."""
    g = Fp8GemmArgs.bind(args, kwargs)
    if g.gpu_kernel in ("triton", "nvfp4") and interpreter_active():
        return fp8_gemm_on_cuda(g)
    return reference.fp8_gemm(g)


def cast_cuda(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """`fp8fx::cast` on CUDA: the generated cast kernel (the reference for 1-D tensors, batched
    blocks, or without Triton). Either way laid out as the fake says (`torch.empty_like(x)`)."""
    if not triton_available() or x.dim() < 2 or (x.dim() > 2 and block and block[0] != 1):  # batched blocks (bmm operands): rare
        return reference.cast(x, scale, dtype, block)
    from fp8fx.codegen.launch import cast

    return cast(x, scale, dtype, tuple(block))


def cast_cpu(x: Tensor, scale: Tensor, dtype: torch.dtype, block: list[int]) -> Tensor:
    """`fp8fx::cast` on CPU tensors: under Triton's interpreter what a GPU runs; else the reference."""
    return cast_cuda(x, scale, dtype, block) if interpreter_active() else reference.cast(x, scale, dtype, block)


library.cast.register_kernel("cuda")(cast_cuda)
library.cast.register_kernel("cpu")(cast_cpu)
library.scaled_mm.register_kernel("cuda")(scaled_mm_cuda)
library.fp8_gemm.register_kernel("cuda")(fp8_gemm_cuda)
library.fp8_gemm.register_kernel("cpu")(fp8_gemm_cpu)


def _rowwise_scales(s: Tensor, spec: grouped.OperandScales, form: str, side: int, x: Tensor, offs: Tensor) -> Tensor:
    """An operand's scale inverses per row (column) within each group: 2-D x 3-D [M_total] (left)
    and [G, N] (right), 2-D x 2-D [G, M] and [G, N]; a group's (or matrix's) one scale repeated."""
    groups = offs.shape[0]
    if form == "2d-3d" and side == 0:
        return reference.per_index(s, offs, x.shape[0]) if spec.per_group else s.reshape(-1)
    lines = x.shape[-1] if side == 1 else x.shape[0]  # N of the right operand, M of the left one
    return s.reshape(groups, -1).expand(groups, lines).contiguous()


def _line_scales(a, b, scale_inv_a, scale_inv_b, offs, form, scales) -> tuple[Tensor, Tensor]:
    """Both operands' scale inverses as the grouped kernels take them (`_rowwise_scales`)."""
    return tuple(
        _rowwise_scales(s, spec, form, side, x, offs)
        for side, (s, spec, x) in enumerate(zip((scale_inv_a, scale_inv_b), scales, (a, b)))
    )


def _grouped_triton(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, form, scales, fast_accum) -> Tensor:
    """The generated grouped kernel (GPUs, and CPU tensors under Triton's interpreter): scales per
    group or line as lines, scales in blocks along K as they are."""
    if not grouped.rowwise_layout(scales):
        blocks = {"block_a": scales[0].block, "block_b": scales[1].block}
        return grouped_launcher()(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, fast_accum=fast_accum, **blocks)
    sa, sb = _line_scales(a, b, scale_inv_a, scale_inv_b, offs, form, scales)
    return grouped_launcher()(a, b, sa, sb, offs, out_dtype, fast_accum=fast_accum)


def fp8_grouped_mm_cpu(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, block_a, block_b, fast_accum=False) -> Tensor:
    """`fp8fx::fp8_grouped_mm` on CPU tensors: under Triton's interpreter the generated grouped kernel,
    as a GPU runs it; else the exact emulation."""
    form, scales = reference.check_grouped_args(a, b, scale_inv_a, scale_inv_b, offs, block_a, block_b)
    if interpreter_active():
        return _grouped_triton(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, form, scales, fast_accum)
    return reference.fp8_grouped_mm(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, block_a, block_b, fast_accum)


def fp8_grouped_mm_cuda(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, block_a, block_b, fast_accum=False) -> Tensor:
    """`fp8fx::fp8_grouped_mm` on CUDA: the kernel `fp8fx.core.grouped.gpu_kernel` names. For
    `torch._scaled_grouped_mm` each group is padded to a multiple of 16 (rows of the 2-D x 3-D
    form, K of the 2-D x 2-D one: zero rows and K-slices change no product)."""
    form, scales = reference.check_grouped_args(a, b, scale_inv_a, scale_inv_b, offs, block_a, block_b)
    formats = tuple(fp8_format_of(x.dtype).value for x in (a, b))
    kernel, _ = grouped.gpu_kernel(formats, scales, grouped_launcher() is not None)
    if kernel == "emulated":
        return reference.fp8_grouped_mm(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, block_a, block_b, fast_accum)
    if kernel == "triton":
        return _grouped_triton(a, b, scale_inv_a, scale_inv_b, offs, out_dtype, form, scales, fast_accum)
    sa, sb = _line_scales(a, b, scale_inv_a, scale_inv_b, offs, form, scales)
    rows = a.shape[0]
    if form == "2d-3d":
        a, sa = reference.pad_groups(a, offs, 0, ALIGN), reference.pad_groups(sa[:, None], offs, 0, ALIGN)[:, 0]
    else:
        a, b, sa = reference.pad_groups(a, offs, 1, ALIGN), reference.pad_groups(b, offs, 0, ALIGN), sa.reshape(-1)
    b = b.transpose(-2, -1).contiguous().transpose(-2, -1)  # column-major
    padded = reference.pad_offsets(offs, ALIGN)
    out = torch._scaled_grouped_mm(
        a, b, sa, sb.reshape(-1) if form == "2d-2d" else sb, offs=padded, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
    )
    if form == "2d-3d":  # the rows back from their padded places; a row of no group is 0
        out = torch.cat([out, out.new_zeros(1, out.shape[1])])[reference.padded_positions(offs, rows, ALIGN)]
    return out.to(out_dtype)


library.fp8_grouped_mm.register_kernel("cuda")(fp8_grouped_mm_cuda)
library.fp8_grouped_mm.register_kernel("cpu")(fp8_grouped_mm_cpu)
