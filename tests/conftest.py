"""Shared test set-up: one thread per torch op (2-core machines run several test processes at once)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
