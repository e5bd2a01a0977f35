"""The GPU's specializations of the decode step's kernels compile for sm_90
(sm90_compile.py), on a machine without a GPU. A kernel the interpreter runs can still be one
the compiler rejects: the all-reduce's float32 flavour once was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90() -> None:
    script = Path(__file__).with_name("sm90_compile.py")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("compiled ")]
    # all-reduce 3 dtypes x 3, GEMV 5, argmax 2, decode attention 2 x (with and without
    # rotary), rotary + KV write 1, skinny GEMM 2, vocabulary-parallel embedding 1
    assert len(lines) == 9 + 5 + 2 + 4 + 1 + 2 + 1, done.stdout
