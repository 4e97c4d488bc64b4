"""fp8fx's 2-block demo transformer, given as a module-level model (real weights)."""

import torch

from fp8fx.tools.demo import TinyTransformer

torch.manual_seed(0)  # the same weights in every run: an export check compares exact values
model = TinyTransformer(dim=64, heads=4, layers=2, max_seq=32)


def example_inputs():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def loss_fn(logits):
    return logits.float().logsumexp(-1).mean()


def calibration_data():
    """Token batches for `--numerics` (a generator: fp8fx takes the first --calibrate of them)."""
    generator = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(0, 256, (2, 32), generator=generator)
