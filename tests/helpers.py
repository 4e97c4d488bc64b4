"""Shared test helpers: SQNR, compiling with the rewritten graphs kept, policy errors, small models."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import fp8fx
from fp8fx.codegen import versions
from fp8fx.core.policy import PolicyError
from fp8fx.core.policy_yaml import policy_from_yaml

BENCH = Path(__file__).resolve().parents[1] / "bench"

# Bounds for tensorwise HYBRID scaling on tiny models (hidden 64): outputs measure 25-28 dB,
# weight gradients 18-27 dB. E5M2 gradients carry 2 mantissa bits, so 15 dB is the honest floor.
OUTPUT_SQNR_DB = 20.0
GRAD_SQNR_DB = 15.0

SCALED_MM = torch.ops.fp8fx.scaled_mm.default
FP8_GEMM = torch.ops.fp8fx.fp8_gemm.default  # an FP8 GEMM with its fused epilogue


# A rowwise case of a GPU's cuBLAS graph run on torch's CPU `_scaled_mm`.
CUBLAS_ROWWISE = pytest.param(
    "rowwise",
    marks=pytest.mark.skipif(
        not versions.cpu_rowwise_scaled_mm(), reason=f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only"
    ),
)


def sqnr(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of `actual` against `reference`."""
    actual, reference = actual.double(), reference.double()
    return (20 * torch.log10(reference.norm() / (actual - reference).norm())).item()


def assert_policy_yaml_error(text: str, key_path: str, line: int, fragment: str) -> None:
    """`text` as a policy file fails with one line naming `key_path` at `line` and saying `fragment`."""
    with pytest.raises(PolicyError) as info:
        policy_from_yaml(text, source="p.yaml")
    e = info.value
    assert (e.key_path, e.line) == (key_path, line), str(e)
    assert fragment in str(e) and "\n" not in str(e)


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


@dataclass
class Captured:
    """A model compiled with the eager fp8fx backend, which keeps the graphs it runs."""

    backend: fp8fx.Fp8fxBackend
    compiled: object

    @property
    def dynamo_backend(self) -> fp8fx.Fp8fxBackend:  # to compile more callables with the same backend
        return self.backend

    @property
    def report(self) -> fp8fx.Report:
        return fp8fx.report(self.backend)

    @property
    def forward(self) -> list[fx.GraphModule]:  # forward and inference graphs
        return [g for kind, g in self.backend.kept_graphs if kind != "backward"]

    @property
    def backward(self) -> list[fx.GraphModule]:
        return [g for kind, g in self.backend.kept_graphs if kind == "backward"]

    def scaled_mm_nodes(self) -> int:
        """FP8 GEMM nodes, fused (fp8_gemm) or not (scaled_mm: batched GEMMs)."""
        return sum(count(g, SCALED_MM) + count(g, FP8_GEMM) for g in self.forward + self.backward)


def compile_captured(model: nn.Module, policy: fp8fx.Policy | None = None, weight_fp8: str = "auto", **compile_kwargs) -> Captured:
    """`torch.compile(model, backend=fp8fx.backend(policy, inner="eager", keep_graphs=True))`."""
    backend = fp8fx.backend(policy=policy, inner="eager", keep_graphs=True, weight_fp8=weight_fp8)
    return Captured(backend, torch.compile(model, backend=backend, **compile_kwargs))


class GatedBlock(nn.Module):
    """linear + bias + gelu, a gated MLP and a residual add: every epilogue the pass fuses."""

    def __init__(self, d=64, hidden=128):
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.gate = nn.Linear(hidden, d, bias=False)
        self.up = nn.Linear(hidden, d, bias=False)
        self.down = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = nn.functional.gelu(self.fc(x))
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(cfg)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256
    )
    return LlamaForCausalLM(cfg)


def one_layer_llama():
    """A seeded one-layer `transformers` Llama (hidden 64, vocab 512) without KV cache: every GEMM role of
    a decoder layer and the LM head, small enough to compile quickly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512, use_cache=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def fp8fx_calls(code: list[str] | str) -> list[str]:
    """The fp8fx ops Inductor's generated code calls, in order."""
    return re.findall(r"torch\.ops\.fp8fx\.(\w+)\.default\(", code if isinstance(code, str) else "\n".join(code))


def meta_llama(layers: int, hidden: int = 128, inter: int = 256, heads: int = 4, kv: int = 2, vocab: int = 512):
    """A `transformers` Llama built on the meta device (shapes only, no weights), without KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def bench_module(name: str):
    """bench/<name>.py loaded as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kept_for_backward(params, forward) -> tuple[dict[int, tuple[int, torch.dtype]], torch.Tensor]:
    """The distinct storages autograd keeps for backward while `forward()` runs, `params` left out
    (data pointer -> (bytes, dtype)), and what `forward()` returned, to run backward from."""
    skipped = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skipped:
            kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return kept, out

