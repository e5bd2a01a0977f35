"""Tuned block configurations of a kernel, one JSON file per (device, dtype).

    kernels/configs/<kernel>/device_name=<GPU name, spaces as _>,dtype=<dtype>.json
    {"<shape key: comma-joined ints>": {<config fields>} or null, ...}

A kernel's benchmark program writes the fastest candidate of each shape it measured (`--save`);
the launcher looks its shape up and falls back to its untuned choice where this device or shape
has no entry. A null entry records that the kernel lost to the alternative it was timed against
on that shape (the caller then takes the alternative).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

logger = logging.getLogger(__name__)
CONFIG_ROOT = Path(__file__).parent / "configs"

C = TypeVar("C")
Key = tuple[int, ...]


class TunedConfigs(Generic[C]):
    """The tuned files of one kernel; `config_type` is its frozen config dataclass."""

    def __init__(self, kernel: str, config_type: type[C]) -> None:
        self.directory = CONFIG_ROOT / kernel
        self._type = config_type
        self._lock = threading.Lock()
        self._tables: dict[tuple[Path, str, torch.dtype], dict[Key, C | None]] = {}
        self._names: dict[int, str] = {}

    @staticmethod
    def file_name(device_name: str, dtype: torch.dtype) -> str:
        device = device_name.replace(" ", "_")
        return f"device_name={device},dtype={str(dtype).removeprefix('torch.')}.json"

    def load(self, device_name: str, dtype: torch.dtype) -> dict[Key, C | None]:
        """{shape key: config or None} for this device and dtype; empty without a file. Read
        once per process (cached); `save` refreshes it."""
        cache_key = (self.directory, device_name, dtype)
        with self._lock:
            table = self._tables.get(cache_key)
            if table is None:
                table = self._read(self.directory / self.file_name(device_name, dtype))
                self._tables[cache_key] = table
            return table

    def _read(self, path: Path) -> dict[Key, C | None]:
        if not path.is_file():
            return {}
        raw: dict[str, Any] = json.loads(path.read_text())
        logger.info("%s: using tuned configs %s", self.directory.name, path.name)
        return {
            tuple(int(v) for v in key.split(",")): None if cfg is None else self._type(**cfg)
            for key, cfg in raw.items()
        }

    def save(self, device_name: str, dtype: torch.dtype, configs: dict[Key, C | None]) -> Path:
        """Merge `configs` into this device's file (keys already there are replaced)."""
        path = self.directory / self.file_name(device_name, dtype)
        table = dict(self.load(device_name, dtype))
        table.update(configs)
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = {
            ",".join(map(str, key)): None if cfg is None else dataclasses.asdict(cfg)  # type: ignore[call-overload]
            for key, cfg in sorted(table.items())
        }
        path.write_text(json.dumps(raw, indent=1) + "\n")
        with self._lock:
            self._tables.pop((self.directory, device_name, dtype), None)
        return path

    def get(
        self, device: torch.device, dtype: torch.dtype, key: Key, default: C | None
    ) -> C | None:
        """The tuned entry of `key` on `device` (None where the kernel lost), else `default`."""
        if device.type != "cuda":
            return default
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = self._names.get(index)
        if name is None:  # looked up once: launchers call this per projection
            name = self._names[index] = torch.cuda.get_device_name(index)
        return self.load(name, dtype).get(key, default)
