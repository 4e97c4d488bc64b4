"""The order of backward's GEMMs in the graphs Inductor gets (`fp8fx.compiler.ordering`)."""

from __future__ import annotations

import pytest
import torch
from helpers import CUBLAS_ROWWISE

import fp8fx
from fp8fx.compiler import lowering
from fp8fx.passes.annotation import annotation


class GatedMLP(torch.nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("recipe", ["tensorwise", CUBLAS_ROWWISE])
def test_each_input_gradient_runs_before_its_weight_gradient(recipe, monkeypatch):
    """Backward as the autograd engine and torchao order it: a layer's input gradient, then its
    weight gradient. Autograd traces `mm`'s backward weight gradient first, and the partitioner
    recomputes a forward value just before its first reader: the down projection's operand (SiLU's
    output, from the gate output backward keeps) was recomputed ahead of the input gradient, apart
    from SiLU's backward, which reads the same sigmoid; Inductor then kept it across the GEMM. Each
    recompute (SiLU's `exp`) now follows the down projection's input gradient."""
    backward = []
    lower = lowering.lower_elementwise

    def record(gm, *args):
        if any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes):
            backward.extend(gm.graph.nodes)
        return lower(gm, *args)

    monkeypatch.setattr(lowering, "lower_elementwise", record)
    model = torch.nn.Sequential(GatedMLP(), GatedMLP()).to(torch.bfloat16)
    policy = fp8fx.Policy.from_recipe(recipe)
    backend = fp8fx.backend(policy=policy, inner="inductor", cublas_devices=("cpu", "cuda"))  # the graph a GPU runs
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        compiled(x).float().pow(2).mean().backward()
    gemms = {(a.site, a.role): i for i, n in enumerate(backward) if (a := annotation(n)) is not None}
    sites = {site for site, _ in gemms}
    assert len(gemms) == 12 and len(sites) == 6
    assert all(gemms[site, "grad_input"] < gemms[site, "grad_weight"] for site in sites)
    exps = [i for i, n in enumerate(backward) if n.target is torch.ops.aten.exp.default]
    assert len(exps) == 2
    for i in exps:
        site, role = max(((s, r) for (s, r), j in gemms.items() if j < i), key=gemms.__getitem__)
        assert site.endswith("down") and role == "grad_input"
