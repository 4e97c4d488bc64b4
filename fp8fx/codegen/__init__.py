"""GPU kernels and their launchers. Today: the `torch._scaled_mm` launcher for CUDA tensors."""
