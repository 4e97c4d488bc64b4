"""A 3-layer MLP; the last layer's N (10) is not a multiple of 16, so it stays high."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10))


def example_inputs():
    return (torch.randn(32, 64),)
