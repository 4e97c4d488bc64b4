"""A 3-layer MLP to train: build_model() makes the same weights every time fp8fx seeds it."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))


def example_inputs():
    return (torch.randn(64, 32),)


def loss_fn(output):
    return output.float().pow(2).mean()
