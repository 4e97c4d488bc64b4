"""What runs beside a compiled model: the cast monitor, shadow checks, numerics probes, and the FP8 optimizer."""
