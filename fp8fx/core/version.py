"""fp8fx's version (`fp8fx.__version__`, pyproject.toml's), where every package can read it: the
public API in `fp8fx/__init__.py` sits above them all."""

VERSION = "0.1.0"
