"""Shared test helpers: SQNR, compiling with a capture of the partitioned graphs, small models."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from functorch.compile import make_boxed_func
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import fp8fx

SCALED_MM = torch.ops.fp8fx.scaled_mm.default


def sqnr(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of `actual` against `reference`."""
    actual, reference = actual.double(), reference.double()
    return (20 * torch.log10(reference.norm() / (actual - reference).norm())).item()


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


@dataclass
class Captured:
    """A model compiled with fp8fx's passes, keeping the graphs it produced."""

    backend: fp8fx.Fp8fxBackend
    dynamo_backend: object  # pass to torch.compile(..., backend=) to compile more callables
    compiled: object = None
    forward: list[fx.GraphModule] = field(default_factory=list)  # forward or inference graphs
    backward: list[fx.GraphModule] = field(default_factory=list)

    @property
    def report(self) -> fp8fx.Report:
        return fp8fx.report(self.backend)

    def scaled_mm_nodes(self) -> int:
        return sum(count(g, SCALED_MM) for g in self.forward + self.backward)


def compile_captured(model: nn.Module, policy: fp8fx.Policy | None = None) -> Captured:
    """Like `torch.compile(model, backend=fp8fx.backend(inner="eager"))`, but keeps the graphs.

    Drives aot_autograd exactly as the eager backend does, calling the backend's own rewrite."""
    backend = fp8fx.backend(policy=policy, inner="eager")
    def dynamo_backend(gm, example_inputs):
        def partition_fn(joint, joint_inputs, **kwargs):
            backend.rewrite(joint, [])
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def fw(g, _):
            cap.forward.append(g)
            return make_boxed_func(g)

        def bw(g, _):
            cap.backward.append(g)
            return make_boxed_func(g)

        def inference(g, _):
            cap.forward.append(backend.rewrite(g, []))
            return make_boxed_func(g)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw, inference_compiler=inference, partition_fn=partition_fn)(
            gm, example_inputs
        )

    cap = Captured(backend, dynamo_backend)
    cap.compiled = torch.compile(model, backend=dynamo_backend)
    return cap


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256
    )
    return LlamaForCausalLM(cfg)
