"""When speculation stops paying: the batch size above which a worker stops drafting.

`--speculative-disable-batch-size auto` resolves here, once per worker, before its
EngineConfig is built (the engine only reads `SpeculativeConfig.disable_batch_size`):
1. the measured table of this device, if there is one:
       thresholds/device_name=<GPU name, spaces as _>.json
       {"device_name": "NVIDIA H100 80GB HBM3", "command": "...",
        "thresholds": {"ngram": {"2": 24, "4": 16}, ...}}     # method -> k -> batch size
   written by `benchmarks/spec_decode_bench.py --write-threshold` (the largest batch at which
   speculation still gave more output tokens/s than none); the entry of the nearest measured k
   is taken;
2. else `CostModel`: one decode step of B sequences costs (weights read once) + B tokens of
   compute, a verify step B * (k + 1) tokens; with per-draft acceptance a a verify step emits
   E = 1 + a + ... + a^k tokens per sequence, so speculating pays while
       E * (1 + B / R) > 1 + o + B * (k + 1) / R   i.e.   B < R * (E - 1 - o) / (k + 1 - E),
   R being the batch at which a step turns compute-bound (the roofline's ridge, in tokens) and
   o the proposer's and verifier's overhead (a fraction of a batch-1 step).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
TABLE_DIR = Path(__file__).parent / "thresholds"


@dataclass(frozen=True)
class CostModel:
    ridge_tokens: float  # R: tokens per step at which compute time equals the weights' read
    acceptance: float = 0.5  # a: the chance a draft is accepted (n-gram drafts on ordinary text)
    overhead: float = 0.1  # o: drafting and verification work, per step, over a batch-1 step

    def threshold(self, k: int) -> int:
        """The largest batch at which speculating k tokens still pays (at least 1)."""
        a = self.acceptance
        expected = sum(a**i for i in range(k + 1))  # E
        if expected >= k + 1:  # every draft accepted: pays at any batch the model can run
            return 1 << 16
        bound = self.ridge_tokens * (expected - 1 - self.overhead) / (k + 1 - expected)
        return max(1, math.ceil(bound) - 1)


# The ridge R per kind of device, for a device without a measured table: a CPU's matmuls turn
# compute-bound at a few tokens. A GPU's would at its FLOP/s over its bytes/s (H100 bf16:
# ~295), but a speculating step is not chained ahead (async_scheduling.py), so its host work
# (~0.3 ms) adds to every step, and a small model's step time grows with its rows long before
# that ridge: measured with the bundled model (benchmarks/spec_decode_bench.py (c)),
# n-gram drafting paid up to batch 2-4 on an H100 and an H200. R = 16 and o = 0.3 give 5, 4
# and 3 for k = 2, 3, 4: close to those, and erring towards speculating less.
COST_MODELS = {
    "cpu": CostModel(ridge_tokens=8.0),
    "cuda": CostModel(ridge_tokens=16.0, overhead=0.3),
}


def device_name(device: str) -> str:
    """The name measured tables are keyed by: the GPU's name, or "cpu"."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def table_path(name: str) -> Path:
    return TABLE_DIR / f"device_name={name.replace(' ', '_')}.json"


def measured(name: str, method: str, k: int) -> int | None:
    """The measured threshold of `method` at the k nearest to `k` on device `name`, if any."""
    path = table_path(name)
    if not path.is_file():
        return None
    by_k: dict[str, Any] = json.loads(path.read_text()).get("thresholds", {}).get(method, {})
    if not by_k:
        return None
    nearest = min(by_k, key=lambda key: (abs(int(key) - k), int(key)))
    return max(1, int(by_k[nearest]))


def resolve(device: str, method: str, k: int) -> tuple[int, str]:
    """("auto") the batch size above which speculation stops on `device`, and where it came
    from ("measured" or "cost model") for the start-up log."""
    name = device_name(device)
    value = measured(name, method, k)
    if value is not None:
        return value, f"measured on {name}"
    model = COST_MODELS["cuda" if device.startswith("cuda") else "cpu"]
    return model.threshold(k), f"cost model for {name}"


def write_measured(name: str, method: str, k: int, value: int, command: str) -> Path:
    """Record a measured threshold (the benchmark's `--write-threshold`), keeping the others."""
    path = table_path(name)
    table: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    table["device_name"] = name
    table["command"] = command
    table.setdefault("thresholds", {}).setdefault(method, {})[str(k)] = int(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return path
