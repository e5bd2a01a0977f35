"""Tiny random-weight EAGLE-1 and EAGLE-3 head checkpoints in their published layouts, matching
tiny_models' targets (hidden 64, vocabulary 260), written by the tests: `eagle.py`."""
