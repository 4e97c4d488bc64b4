"""GPU kernels and how they are chosen and launched; imports nothing of fp8fx but `fp8fx.core`.

`versions` (whether Triton is installed, which release, what it lacks), `variants` (what a kernel is,
per target) and `dispatch` (which kernel runs a GEMM, what `torch._scaled_mm` can run) import no
Triton; `triton_kernels` / `tma_kernel` / `grouped_kernel` (the kernels), `launch` (their one
launcher) and `targets` (offline builds for sm_89 / sm_90a / sm_100a) need it. Imports run one way,
versions < variants < launch < dispatch: `dispatch` imports the launcher only when asked for it.
The ops that run them are `fp8fx.ops.cuda`'s."""
