"""Shared test set-up: one thread per torch op (2-core machines run several test processes at once), and Ray's
local-cluster settings before any test module imports ray (Ray reads them once, at import), so every test file
also runs alone."""

import os

from slime_hydra.cluster.local_ray import set_local_ray_env

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
set_local_ray_env()
