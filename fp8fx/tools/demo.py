"""A small pre-norm transformer and a few training steps under fp8fx: the `fp8fx demo` command."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8fx.compiler.backend import backend, report
from fp8fx.reporting.records import Report


class Block(nn.Module):
    """Pre-norm attention + MLP block; attention written with matmuls so its bmm sites show."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, max_seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


@dataclass
class DemoResult:
    losses: list[float]
    fp32_losses: list[float]
    report: Report


def run_demo(steps: int = 10, inner: str = "eager", seed: int = 0, batch: int = 8, seq: int = 32) -> DemoResult:
    """Train the same TinyTransformer with fp8fx and in fp32 eager on the same batches.

    The task is next-token prediction on a repeating pattern, so the loss visibly falls."""
    torch.manual_seed(seed)
    model = TinyTransformer(max_seq=seq)
    reference = TinyTransformer(max_seq=seq)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=backend(inner=inner))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    losses, fp32_losses = [], []
    for _ in range(steps):
        start = torch.randint(0, 200, (batch, 1), generator=gen)
        data = (start + torch.arange(seq + 1) * 3) % 256
        x, y = data[:, :-1], data[:, 1:]
        for m, o, out in ((compiled, opt, losses), (reference, ref_opt, fp32_losses)):
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            o.zero_grad()
            loss.backward()
            o.step()
            out.append(loss.item())
    return DemoResult(losses, fp32_losses, report(compiled))
