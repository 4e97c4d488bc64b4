"""Tools built on the passes: model files and `analyze`, policy suggestion, divergence bisection,
ONNX export, the demo and the GPU self-test."""
