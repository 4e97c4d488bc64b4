"""Training through the frameworks users run: fp8fx vs plain `torch.compile` (Inductor) vs eager,
per integration, with a sequence length that varies from batch to batch.

Run: python bench/integrations.py [--only hf,accelerate,lightning] [--steps 20] [--dim 128]
For each integration (Hugging Face Trainer with `fp8fx.integrations.transformers.enable`,
Accelerate's `prepare` on a model compiled in place, Lightning with `Fp8fxCallback`) and each mode
(eager, plain Inductor, fp8fx with inner="inductor"), one process trains a `transformers` Llama
(2 layers, random weights, batch 4) for `--steps` steps on sequences of 48-112 tokens, padded per
batch. Prints the first step (compile + run), steps/s over the rest (median step), and the graphs
Dynamo compiled (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`: the first shape, one
recompile to dynamic shapes, then none is the expected count). Compile caches are off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings

MODES = ("eager", "inductor", "fp8fx")
INTEGRATIONS = ("hf", "accelerate", "lightning")
BATCH = 4


def llama(dim: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=2, num_attention_heads=max(1, dim // 32),
                                      vocab_size=256, max_position_embeddings=128)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batches(steps: int) -> list[dict]:
    """`steps` batches whose length cycles through 48-112 tokens (a new length most steps)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(steps):
        ids = torch.randint(0, 256, (BATCH, 48 + (i * 24) % 72), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def compile_model(model, mode: str):
    import fp8fx

    if mode == "inductor":
        model.compile(backend="inductor")
    elif mode == "fp8fx":
        model.compile(backend=fp8fx.backend(inner="inductor"))
    return model


def run_hf(model, data: list[dict], mode: str) -> list[float]:
    import torch
    import transformers

    from fp8fx.integrations.transformers import enable

    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    samples = [{k: v[j] for k, v in batch.items()} for batch in data for j in range(BATCH)]

    def collate(rows):  # batches are cut in order, one length each
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    args = transformers.TrainingArguments("/tmp/fp8fx-bench-hf", max_steps=len(data), per_device_train_batch_size=BATCH, report_to=[],
                                          use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples, data_collator=collate, callbacks=[Timer()])
    trainer._get_train_sampler = lambda *a: torch.utils.data.SequentialSampler(
        samples
    )  # keep batches whole: one length per batch
    if mode == "fp8fx":
        enable(trainer, inner="inductor")
    else:
        compile_model(model, mode)
    trainer.train()
    return times


def run_accelerate(model, data: list[dict], mode: str) -> list[float]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    compile_model(model, mode)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = []
    for batch in data:
        start = time.perf_counter()
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def run_lightning(model, data: list[dict], mode: str) -> list[float]:
    import lightning
    import torch

    from fp8fx.integrations.lightning import Fp8fxCallback

    times: list[float] = []

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

        def training_step(self, batch, _):
            return self(**batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args):
            times.append(time.perf_counter() - self.start)

    module = Module()
    callbacks = []
    if mode == "fp8fx":
        callbacks.append(Fp8fxCallback(inner="inductor"))
    else:
        compile_model(module, mode)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=len(data), logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return times


def child(integration: str, mode: str, steps: int, dim: int) -> dict:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    from torch._dynamo.utils import counters

    runner = {"hf": run_hf, "accelerate": run_accelerate, "lightning": run_lightning}[integration]
    times = runner(llama(dim), batches(steps), mode)
    return {"first": times[0], "step": statistics.median(times[1:]), "graphs": counters["stats"]["unique_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(INTEGRATIONS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--child", nargs=2, metavar=("INTEGRATION", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.dim)))
        return

    print(f"Llama 2 layers, dim {args.dim}, batch {BATCH}, {args.steps} steps of 48-112 tokens")
    print(f"{'integration':<11} {'mode':<9} {'first s':>8} {'steps/s':>8} {'graphs':>6}  fp8fx step / inductor step")
    for integration in args.only.split(","):
        results = {}
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", integration, mode, "--steps", str(args.steps), "--dim", str(args.dim)]
            done = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if done.returncode:
                print(f"{integration:<11} {mode:<9} error: {(done.stderr.strip().splitlines() or ['?'])[-1][:160]}", flush=True)
                continue
            r = results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
            ratio = f"  {r['step'] / results['inductor']['step']:.2f}" if mode == "fp8fx" and "inductor" in results else ""
            print(f"{integration:<11} {mode:<9} {r['first']:>8.1f} {1 / r['step']:>8.1f} {r['graphs']:>6}{ratio}", flush=True)


if __name__ == "__main__":
    main()
