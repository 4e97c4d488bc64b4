"""A stack of identical blocks, each holding several matrix products (sites `layers.i:bmm#j` and
`layers.i:mm#j`), between two modules holding one Linear each (sites `embed` and `head`)."""

import math

import torch
from torch import nn
from torch.nn import functional as F

DIM, HIDDEN, LAYERS = 32, 64, 3


class Block(nn.Module):
    """Attention-like scores and mixing (two bmm, no weight) and a gated MLP (three mm)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(dim, hidden) / math.sqrt(dim))
        self.w_gate = nn.Parameter(torch.randn(dim, hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(hidden, dim) / math.sqrt(hidden))

    def forward(self, x):
        scores = (x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])).softmax(-1)  # bmm#0
        x = x + scores @ x  # bmm#1
        return x + (F.gelu(x @ self.w_in) * (x @ self.w_gate)) @ self.w_out  # mm#0, mm#1, mm#2


class Blocks(nn.Module):
    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Linear(16, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, 16)

    def forward(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def build_model():
    return Blocks()


def example_inputs():
    return (torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)),)
