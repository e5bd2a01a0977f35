"""Tiny random-weight vision-language checkpoints (real HF layouts, with their processor
configs), written by the tests: `llava.py` and `qwen2_vl.py`."""
