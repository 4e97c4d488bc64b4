"""A model file whose import fails."""

import torch

undefined_name + 1  # noqa: F821
