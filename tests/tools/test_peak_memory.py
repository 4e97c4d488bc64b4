"""bench/peak_memory.py's peak: what an allocator trace held at most, without the temporaries torch's
CPU `_scaled_mm` makes and frees inside itself (cuBLAS allocates none on a GPU)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))


def test_the_peak_leaves_out_what_scaled_mm_frees_inside_itself():
    import peak_memory

    inside = ("aten::matmul", peak_memory.SCALED_MM, "aten::to")  # an fp32 upcast inside the GEMM
    out = ("aten::matmul", peak_memory.SCALED_MM, "aten::empty")  # the GEMM's result, freed after it
    events = [(1, 10, 100, ("aten::empty",)), (2, 11, 400, inside), (3, 12, 50, out), (4, 11, -400, inside),
              (5, 13, 30, ("aten::add",)), (6, 12, -50, ("aten::add",)), (7, 14, 40, ("aten::mul",)), (8, 10, -100, ())]  # fmt: skip
    top, alive = peak_memory.peak(events)
    assert top == 180 and dict(alive) == {100: 1, 50: 1, 30: 1}  # 100 + 50 + 30, before the result is freed
    events[3] = (4, 11, -400, ("aten::add",))  # freed outside the GEMM: the upcast counts
    assert peak_memory.peak(events)[0] == 550


def test_the_gpu_rule_stores_no_value_a_gpu_computes_where_read():
    """`fusion_counts.gpu_realize_rule`: a sigmoid two reductions read is stored on a CPU (Inductor's
    rule for exp, sigmoid and the like there), computed where read on a GPU. The rule must change
    what Inductor stores, or the benches' GPU figures are a CPU's."""
    from fusion_counts import gpu_realize_rule
    from torch._inductor.utils import run_and_get_code

    def f(x):
        s = torch.sigmoid(x)
        return s.sum(0), (s * 2).sum(1)

    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    codes = []
    with torch._inductor.config.patch(fx_graph_cache=False):
        for rule in (contextlib.nullcontext(), gpu_realize_rule()):
            torch._dynamo.reset()
            with rule:
                out, (code,) = run_and_get_code(torch.compile(f), x)
            codes.append(code)
            torch.testing.assert_close(out, f(x))
    stored = [code.count("empty_strided_cpu((64, 96)") for code in codes]
    assert stored == [1, 0]
