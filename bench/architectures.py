"""Report coverage over the architectures `transformers` ships, built tiny with random weights.

Run: python bench/architectures.py [--only llama,gpt2] [--json OUT]
For each architecture (hidden 64, 2 layers, 4 heads, intermediate 128, vocab 256; configs made in
code, nothing downloaded) one training step (forward, mean squares of the outputs, backward)
runs compiled with fp8fx (inner="eager"). An oracle counts the GEMMs eager PyTorch dispatches for
the same step of the same model, each as the report counts it (a matmul-like op, a fused attention
kernel, a convolution and each gradient its backward computes, an opaque or custom matrix op).
A plain aot_eager compile of the same step counts the same ops in the graphs it captures (they
differ from eager where Dynamo runs code eagerly or the model takes another path when compiled).
Prints per architecture: both counts, the report's rows (graphs in use), whether rows and the
eager count agree, the FP8 share of GEMM FLOPs forward / backward and what stays high by reason kind and op.
An architecture that fails to build or run prints its error in one line.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from collections import Counter

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import fp8fx
from fp8fx.core.patterns import BY_TARGET, OPAQUE
from fp8fx.passes.find_matmuls import (
    _conv_gemms,
    fused_backward,
    is_conv,
    is_matrix_product,
)

TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 64, "pad_token_id": 0}
LLAMA_LIKE = dict(TEXT, head_dim=16, num_key_value_heads=4)
ENC_DEC = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
           "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 256, "pad_token_id": 0, "bos_token_id": 0,
           "eos_token_id": 0, "decoder_start_token_id": 0}
VISION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "image_size": 32, "patch_size": 8}
MOE = dict(LLAMA_LIKE, num_experts_per_tok=2)

# name: (model_type, auto class, config overrides, inputs)
ARCHITECTURES = {
    "llama": ("llama", "AutoModelForCausalLM", LLAMA_LIKE, "text"),
    "mistral": ("mistral", "AutoModelForCausalLM", LLAMA_LIKE, "text"),
    "qwen2": ("qwen2", "AutoModelForCausalLM", LLAMA_LIKE, "text"),
    "qwen3": ("qwen3", "AutoModelForCausalLM", LLAMA_LIKE, "text"),
    "gemma": ("gemma", "AutoModelForCausalLM", LLAMA_LIKE, "text"),
    "gemma2": ("gemma2", "AutoModelForCausalLM", dict(LLAMA_LIKE, query_pre_attn_scalar=16), "text"),
    "phi3": ("phi3", "AutoModelForCausalLM", TEXT, "text"),
    "gpt2": ("gpt2", "AutoModelForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "vocab_size": 256, "n_positions": 64}, "text"),
    "gpt_neox": ("gpt_neox", "AutoModelForCausalLM", TEXT, "text"),
    "opt": ("opt", "AutoModelForCausalLM", dict(TEXT, ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1), "text"),
    "falcon": ("falcon", "AutoModelForCausalLM", dict(TEXT, ffn_hidden_size=128), "text"),
    "bert": ("bert", "AutoModel", TEXT, "text"),
    "roberta": ("roberta", "AutoModel", dict(TEXT, max_position_embeddings=66, pad_token_id=1), "text"),
    "distilbert": ("distilbert", "AutoModel", {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128, "vocab_size": 256, "max_position_embeddings": 64}, "text"),
    "t5": ("t5", "AutoModelForSeq2SeqLM", {"d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16, "vocab_size": 256, "decoder_start_token_id": 0}, "seq2seq"),
    "bart": ("bart", "AutoModelForSeq2SeqLM", dict(ENC_DEC, max_position_embeddings=64), "seq2seq"),
    "vit": ("vit", "AutoModel", VISION, "image"),
    "clip_vision": ("clip_vision_model", "AutoModel", VISION, "image"),
    "clip_text": ("clip_text_model", "AutoModel", dict(TEXT, pad_token_id=1, bos_token_id=0, eos_token_id=2), "text"),
    "whisper": ("whisper", "AutoModelForSpeechSeq2Seq", dict(ENC_DEC, num_mel_bins=16, max_source_positions=16, max_target_positions=32), "audio"),
    "mixtral": ("mixtral", "AutoModelForCausalLM", dict(MOE, num_local_experts=4), "text"),
    "olmoe": ("olmoe", "AutoModelForCausalLM", dict(MOE, num_experts=4), "text"),
    "qwen2_moe": ("qwen2_moe", "AutoModelForCausalLM", dict(MOE, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=128), "text"),
    "gemma3": ("gemma3_text", "AutoModelForCausalLM", dict(LLAMA_LIKE, query_pre_attn_scalar=16), "text"),
    "granite": ("granite", "AutoModelForCausalLM", LLAMA_LIKE, "text"),
    "starcoder2": ("starcoder2", "AutoModelForCausalLM", dict(TEXT, num_key_value_heads=4), "text"),
    "phi": ("phi", "AutoModelForCausalLM", TEXT, "text"),
    "gptj": ("gptj", "AutoModelForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "vocab_size": 256, "n_positions": 64, "rotary_dim": 8}, "text"),
    "bloom": ("bloom", "AutoModelForCausalLM", {"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}, "text"),
    "albert": ("albert", "AutoModel", dict(TEXT, embedding_size=32), "text"),
    "electra": ("electra", "AutoModel", dict(TEXT, embedding_size=32), "text"),
    "deberta_v2": ("deberta-v2", "AutoModel", TEXT, "text"),
    "swin": ("swin", "AutoModel", {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2], "window_size": 4}, "image"),
    "siglip_vision": ("siglip_vision_model", "AutoModel", VISION, "image"),
    "wav2vec2": ("wav2vec2", "AutoModel", dict(TEXT, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                           num_conv_pos_embedding_groups=4, layerdrop=0.0), "wave"),  # LayerDrop: random layers
    "qwen3_moe": ("qwen3_moe", "AutoModelForCausalLM", dict(MOE, num_experts=4, moe_intermediate_size=64), "text"),
    "mamba": ("mamba", "AutoModelForCausalLM", {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "state_size": 8, "intermediate_size": 128, "pad_token_id": 0}, "text"),
}


class CountRows(TorchDispatchMode):
    """Counts the report rows the GEMMs eager PyTorch dispatches should give: one per matmul-like,
    opaque or fused-attention op, one per gradient a convolution_backward or a fused custom backward
    computes; the predicates are find_matmuls' own, applied to a one-node graph of each call."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in BY_TARGET or func in OPAQUE or func in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default) \
                or func.namespace not in ("aten", "prims") or func.__name__.startswith("_scaled_dot_product"):
            self.count += rows(func, args, kwargs, out)
        return out


def rows(func, args, kwargs, out) -> int:
    """`gemm_rows` of one eager call, made a node of a one-node graph with its tensors as values."""
    graph = fx.Graph()

    def placeholder(a):
        if not isinstance(a, torch.Tensor):
            return a
        node = graph.placeholder(f"t{len(graph.nodes)}")
        node.meta["val"] = a
        return node

    node = graph.call_function(func, tuple(tree_map(placeholder, list(args))), tree_map(placeholder, kwargs))
    node.meta["val"] = out
    return gemm_rows(node)


def gemm_rows(node: fx.Node) -> int:
    """The report rows an ATen graph node should give (see find_matmuls)."""
    if node.op != "call_function":
        return 0
    if is_conv(node):
        return len(_conv_gemms(node))
    if fused_backward(node):
        return 2
    return int(is_matrix_product(node))


def graph_rows(model, inputs: dict) -> int:
    """GEMM rows of the forward and backward graphs a plain aot_eager compile of the step captures."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    count = 0

    def count_nodes(gm, example_inputs):
        nonlocal count
        count += sum(gemm_rows(node) for node in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=count_nodes, bw_compiler=count_nodes)

    torch._dynamo.reset()
    step(torch.compile(model, backend=backend), inputs)
    return count


def build(model_type: str, auto: str, overrides: dict):
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, auto).from_config(config)


def make_inputs(kind: str, config) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 256, (2, n), generator=g)
    if kind == "text":
        return {"input_ids": ids(16)}
    if kind == "seq2seq":
        return {"input_ids": ids(16), "decoder_input_ids": ids(8)}
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    if kind == "wave":
        return {"input_values": torch.randn(2, 1600, generator=g)}
    frames = 2 * config.max_source_positions  # Whisper's two convolutions halve the frames
    return {"input_features": torch.randn(2, config.num_mel_bins, frames, generator=g), "decoder_input_ids": ids(8)}


def step(fn, inputs: dict) -> None:
    """Forward (with the same random draws each time), then backward from the mean square of every output that has a gradient (an unused
    output such as BERT's pooler would otherwise be differentiated by the compiled joint graph, on
    zero gradients, and not by eager)."""
    torch.manual_seed(0)
    outs = [t for t in tree_flatten(fn(**inputs).to_tuple())[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    sum(t.float().square().mean() for t in outs).backward()


def measure(name: str) -> dict:
    model_type, auto, overrides, kind = ARCHITECTURES[name]
    model = build(model_type, auto, overrides)
    model.train()
    inputs = make_inputs(kind, model.config)
    counter = CountRows()
    with counter:
        step(copy.deepcopy(model), inputs)
    traced = graph_rows(copy.deepcopy(model), inputs)
    torch._dynamo.reset()
    backend = fp8fx.backend(inner="eager")
    step(torch.compile(model, backend=backend), inputs)
    report = fp8fx.report(backend)
    s = report.summary()
    high = Counter((op.reason_kind, op.op) for op in report.high_ops)
    reasons = {}
    for (kind_, op), n in sorted(high.items()):
        reasons.setdefault(kind_, {})[op] = n
    return {
        "oracle": counter.count, "graph_ops": traced, "rows": s["gemms"], "graphs": s["graphs"], "superseded": s["superseded_graphs"],
        "fp8_gemms": s["fp8_gemms"], "fwd": s["fp8_flop_share_forward"], "bwd": s["fp8_flop_share_backward"],
        "high": reasons, "gemms_without_flops": s["gemms_without_flops"],
    }


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architecture names: " + ",".join(ARCHITECTURES))
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ARCHITECTURES)
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(ARCHITECTURES)}")

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    print(f"{'architecture':<13} {'eager':>5} {'aot':>4} {'rows':>4} {'agree':>5} {'graphs':>6} {'fp8 fwd':>7} {'fp8 bwd':>7} {'time':>6}  kept high")
    results = {}
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        try:
            r = measure(name)
        except Exception as e:  # noqa: BLE001 - one line per architecture, then the next
            results[name] = {"error": one_line(e)}
            print(f"{name:<13} error: {one_line(e)}")
            continue
        finally:
            torch._dynamo.reset()
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        graphs = f"{r['graphs']}" + (f"+{r['superseded']}s" if r["superseded"] else "")
        high = "; ".join(f"{k} {sum(v.values())} ({', '.join(f'{op} {n}' for op, n in v.items())})" for k, v in r["high"].items()) or "-"
        agree = "yes" if r["oracle"] == r["rows"] else "NO"
        print(f"{name:<13} {r['oracle']:>5} {r['graph_ops']:>4} {r['rows']:>4} {agree:>5} {graphs:>6} {pct(r['fwd']):>7} {pct(r['bwd']):>7} {r['seconds']:>5.1f}s  {high}", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
