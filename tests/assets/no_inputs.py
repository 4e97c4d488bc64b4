"""A model file that forgot example_inputs()."""

from torch import nn


def build_model():
    return nn.Linear(32, 32)
