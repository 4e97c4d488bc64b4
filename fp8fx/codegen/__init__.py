"""GPU kernels and how they are chosen and launched.

`variants` (what a kernel is, per target) and `dispatch` (which kernel runs a GEMM) import no
Triton; `triton_kernels` / `tma_kernel` (the kernels), `launch` (their one launcher) and `targets`
(offline builds for sm_89 / sm_90a / sm_100a) need it; `scaled_mm_cuda` runs torch._scaled_mm."""
