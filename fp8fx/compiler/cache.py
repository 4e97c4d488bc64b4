"""Compile caches for fp8fx's graphs: what Inductor's FX graph cache and AOTAutograd's cache need
to take them, and the report records kept beside them.

Inductor caches a compile when every custom pass in its config has a key (`CustomGraphPass.uuid`)
and everything else it hashes pickles. fp8fx's joint pass is deterministic given the graph, the
policy, the backend's options and fp8fx's own code, so its key hashes those (`pass_key`). A cache
hit skips the pass, and with it the report records the pass would have made: they are written next
to Inductor's cache when the pass runs (`save_records`) and read back on a hit (`load_records`),
keyed by the Dynamo graph and its inputs as well (`graph_key`).

Compiles whose graphs call back into this process (the monitor, shadow checks and numerics probes
pass handler ids) have no key: Inductor compiles them afresh.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from torch import fx

from fp8fx.reporting.op_record import OpRecord

RECORDS_DIR = "fp8fx-records"


@functools.cache
def source_digest() -> str:
    """A digest of fp8fx's code: a cached compile never outlives a change to the passes."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def tables_digest() -> str:
    """A digest of the measured tables `kernels="auto"` may read: those `fp8fx selftest` wrote and
    those measured at compile (`fp8fx.codegen.autotune.table_files`)."""
    from fp8fx.codegen.autotune import table_files

    h = hashlib.sha256()
    for path in table_files():
        h.update(path.name.encode())
        with contextlib.suppress(FileNotFoundError):  # (deleted since listed: digested as absent)
            h.update(path.read_bytes())
    return h.hexdigest()


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def pass_key(options: dict[str, Any]) -> str:
    """The key of fp8fx's joint pass for a backend's `options` (policy, code generation, ...)."""
    return _digest(source_digest(), options)


def graph_key(pass_key: str, gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """The key of one Dynamo graph's records: the pass key, the graph's code, its inputs and the
    grad mode (the same graph compiles to a training graph, or under no_grad to an inference one)."""
    inputs = [
        (tuple(x.shape), str(x.dtype), tuple(x.stride()), x.requires_grad, isinstance(x, torch.nn.Parameter))
        if isinstance(x, torch.Tensor)
        else repr(x)
        for x in example_inputs
    ]
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    return _digest(pass_key, gm.code, inputs, modes)


def _records_path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / RECORDS_DIR / f"{key}.json"


def save_records(key: str, graphs: list[dict[str, Any]]) -> None:
    """Keep the records of the graphs one compile made: kind, ops, non_gemm_bytes and delayed_states each."""
    path = _records_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = [{**g, "ops": [asdict(op) for op in g["ops"]]} for g in graphs]
    tmp = path.with_suffix(f".{id(data)}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # readers never see a partial file


def load_records(key: str) -> list[dict[str, Any]]:
    """The records `save_records` kept for `key`; raises naming the file when they are missing,
    which means Inductor's cache holds fp8fx compiles whose records were deleted."""
    path = _records_path(key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"fp8fx: Inductor's cache served a compile of fp8fx's, but its report records ({path}) are "
            f"missing or unreadable ({type(e).__name__}); delete the cache directory {path.parents[1]} to recompile"
        ) from None
    names = {f.name for f in fields(OpRecord)}
    return [{**g, "ops": [OpRecord(**_tuples({k: v for k, v in op.items() if k in names})) for op in g["ops"]]} for g in data]


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the records hold."""
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


@contextlib.contextmanager
def kept_whole(ops: tuple) -> Iterator[dict]:
    """Inductor's decomposition tables without `ops` while a compile traces. Yields the
    decompositions taken out, for the joint pass to apply to what the FP8 passes left. (Passing a
    table of one's own to compile_fx makes the FX graph cache bypass every graph: it cannot key it.)
    The table Inductor selects is a merged copy it caches on first use, so that copy loses and
    regains them too: else whichever compile first filled the cache decided, for the whole process,
    whether these ops are kept whole for the passes and whether what they left is decomposed."""
    from torch._inductor import decomposition

    tables = (decomposition.decompositions, decomposition.extra_random_decomps, decomposition.select_decomp_table())
    removed = [(table, op, table.pop(op)) for table in tables for op in ops if op in table]
    try:
        yield {op: fn for _, op, fn in removed}  # the merged table's entry last: the one Inductor would use
    finally:
        for table, op, fn in removed:
            table[op] = fn
