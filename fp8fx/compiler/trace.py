"""What a run that learns what a compile decides, rather than trains, needs: `fp8fx.analyze` runs
a model's batches through a backend of its own, `fp8fx.prepare` one forward and backward of a copy
with fake parameters. Both compile a throwaway copy of the model's code (`compiled_once`) and,
without a loss function, take `default_loss` of the output."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class ModelFileError(Exception):
    """A model file that cannot be analysed; the message says what to change (`fp8fx.analyze`'s
    error, and that of a model whose output gives no default loss)."""


def default_loss(output: Any) -> torch.Tensor:
    """The sum of the output (its `logits`, or its first element): a loss for a backward whose
    gradients only need the shapes a training step has."""
    for value in (output, getattr(output, "logits", None), output[0] if isinstance(output, (tuple, list)) and output else None):
        if isinstance(value, torch.Tensor):
            return value.float().sum()
    raise ModelFileError(
        f"cannot make a loss from the model's output ({type(output).__name__}); define loss_fn(output) in the model file"
    )


@contextlib.contextmanager
def compiled_once(model: nn.Module, backend: Any) -> Iterator[nn.Module]:
    """`model` compiled with `backend` for one run; Dynamo is reset when it ends, since the run
    compiled a throwaway copy of the model's code."""
    try:
        yield torch.compile(model, backend=backend)
    finally:
        torch._dynamo.reset()
