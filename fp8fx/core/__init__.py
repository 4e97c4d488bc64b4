"""What every other part of fp8fx builds on and nothing in it imports from them: FP8 formats,
scale math and granularities, GEMM patterns, the epilogue contract, and the precision policy."""
