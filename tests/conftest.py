"""Shared test set-up: one thread per torch op (2-core machines run several test processes at once), Ray's
local-cluster settings before any test module imports ray (Ray reads them once, at import), so every test file
also runs alone, and what the fork server of this test process preloads."""

import multiprocessing
import os

from slime_hydra.cluster.local_ray import set_local_ray_env

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
set_local_ray_env()

FORKSERVER_PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "transformers.models.qwen2.modeling_qwen2",
                      "peft", "megatron.core", "slime_hydra.train.fsdp", "slime_hydra.train.megatron.backend",
                      "tests.train.harness"]
"""What multiprocessing's fork server imports once per test session. Processes the tests start by the forkserver
method (tests/train/harness.run_ranks' gloo ranks, export.py's) are forked from it with these already imported,
instead of each importing torch, transformers and megatron-core anew (~10-20 s of CPU a process on the 2-core
machine). The server has started no threads and touched no device, which is what makes forking it safe."""
multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
