"""Tuned kernel configuration files (kernels/tuned_configs.py): round trip, and the files the
package ships for the GEMV and the skinny GEMM (plain and gated)."""

from __future__ import annotations

import os

import torch

# Must precede `import triton` on a CPU-only machine: see test_attention_kernels.py.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from llmfleet.kernels import gemv, skinny_gemm  # noqa: E402
from llmfleet.kernels.gemv import GemvConfig  # noqa: E402
from llmfleet.kernels.skinny_gemm import SkinnyConfig  # noqa: E402
from llmfleet.kernels.tuned_configs import TunedConfigs  # noqa: E402


def test_round_trip_per_device_and_dtype(tmp_path) -> None:
    tuned = TunedConfigs("skinny_gemm", SkinnyConfig)
    tuned.directory = tmp_path
    device = "NVIDIA H100 80GB HBM3"
    assert tuned.load(device, torch.bfloat16) == {}
    a, b = SkinnyConfig(64, 256, 2, 4, 3), SkinnyConfig(128, 128)
    tuned.save(device, torch.bfloat16, {(4096, 4096, 8): a, (6144, 4096, 8): None})
    path = tuned.save(device, torch.bfloat16, {(4096, 4096, 8): b})  # replaces the entry
    assert path.name == "device_name=NVIDIA_H100_80GB_HBM3,dtype=bfloat16.json"
    assert tuned.load(device, torch.bfloat16) == {(4096, 4096, 8): b, (6144, 4096, 8): None}
    assert tuned.load(device, torch.float16) == {}  # per dtype
    assert tuned.get(torch.device("cpu"), torch.bfloat16, (4096, 4096, 8), a) == a  # off CUDA


@pytest.mark.parametrize(
    ("tuned", "config_type", "key_len"),
    [
        (gemv.TUNED, GemvConfig, 2),
        (gemv.TUNED_SILU, GemvConfig, 2),
        (skinny_gemm.TUNED, SkinnyConfig, 3),
        (skinny_gemm.TUNED_SILU, SkinnyConfig, 3),
    ],
)
def test_shipped_files_load(tuned: TunedConfigs, config_type: type, key_len: int) -> None:
    """Every file the package ships parses into configs under its own device's name."""
    files = sorted(tuned.directory.glob("*.json"))
    assert files
    for path in files:
        device = path.name.removeprefix("device_name=").split(",dtype=")[0].replace("_", " ")
        assert TunedConfigs.file_name(device, torch.bfloat16) == path.name
        table = tuned.load(device, torch.bfloat16)
        assert table and all(len(key) == key_len for key in table)
        assert any(isinstance(c, config_type) for c in table.values())
        assert all(c is None or isinstance(c, config_type) for c in table.values())
