"""What older Triton releases lack (fp8fx.codegen.versions), and the configs gated on it."""

from __future__ import annotations

import pytest
import torch

from fp8fx.codegen import versions
from fp8fx.codegen.variants import CONFIGS, GROUPED_BLOCK_SCALED_TARGETS, GroupedVariant, TileConfig, _without_warp_specialization

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    "installed,missing",
    [
        ("3.6.0", ["sm100_warp_specialize", "interpreter_dot_scaled", "interpreter_e4m3_scales", "sm90_grouped_wgrad_128x128"]),
        ("3.7.1", ["interpreter_dot_scaled", "interpreter_e4m3_scales"]),
        ("3.8.0", ["interpreter_e4m3_scales"]),
        ("3.9.0", []),
        ("3.10.0+git1234abcd", []),
        (None, []),  # no Triton: nothing of it runs
    ],
)
def test_features_by_release(installed, missing, monkeypatch):
    monkeypatch.setattr(versions, "triton_version_string", lambda: installed)
    assert versions.missing() == missing
    assert len(versions.limits()) == len(missing)


def test_limits_name_the_release_and_the_one_needed(monkeypatch):
    monkeypatch.setattr(versions, "triton_version_string", lambda: "3.6.0")
    assert versions.limits()[0] == "Triton 3.6.0: no sm_100a warp specialization (needs Triton >= 3.7)"


def test_installed_triton_decides_the_configs():
    ws = [c for c in CONFIGS["sm_100a", "tma"] if dict(c.extra).get("WARP_SPECIALIZE")]
    assert bool(ws) == versions.has("sm100_warp_specialize") and CONFIGS["sm_100a", "tma"]
    assert (("interpreter", "mx") in CONFIGS) == versions.has("interpreter_dot_scaled")
    assert ("interpreter" in GROUPED_BLOCK_SCALED_TARGETS) == versions.has("interpreter_dot_scaled")
    wgrad = GroupedVariant(E4M3, E4M3, True).configs("sm_90a")
    assert any(c.block_m * c.block_n == 128 * 128 for c in wgrad) == versions.has("sm90_grouped_wgrad_128x128")
    assert all(c.block_m * c.block_n <= 128 * 128 for c in wgrad) and wgrad


def test_dropping_warp_specialization_keeps_each_tile_once():
    ws, sub4, sub2 = ("WARP_SPECIALIZE", True), ("EPILOGUE_SUBTILE", 4), ("EPILOGUE_SUBTILE", 2)
    configs = (
        TileConfig(128, 128, 128, 8, 8, 4, (sub4, ws)),
        TileConfig(128, 128, 128, 8, 8, 4, (sub4,)),
        TileConfig(128, 64, 128, 8, 8, 4, (sub2, ws)),
    )
    assert _without_warp_specialization(configs) == (
        TileConfig(128, 128, 128, 8, 8, 4, (sub4,)),
        TileConfig(128, 64, 128, 8, 8, 4, (sub2,)),
    )
