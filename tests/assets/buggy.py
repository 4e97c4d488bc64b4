"""A model with a shape bug: the second layer expects 128 features, the first makes 64."""

import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(32, 64), nn.Linear(128, 16))


def example_inputs():
    return (torch.randn(8, 32),)
