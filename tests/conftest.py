"""Shared pytest setup: the repo root and tests/ on sys.path (so plain `pytest` works as well as
`python -m pytest`), and one CPU thread for the tiny test models."""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

# NOTE: the test models are tiny; with several threads on a busy machine every small op pays
# for thread wake-ups (measured: 8 naive generations take 0.8 s on 1 thread, 53 s on 2 threads
# next to a training job). One thread is never slower at this size.
torch.set_num_threads(1)
