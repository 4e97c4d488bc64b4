"""The per-GEMM precision report (`records`), what it predicts on a GPU (`costmodel`, `traffic`),
and how it is shown (`text`, `html`)."""
