"""Shared test set-up: one thread per torch op (2-core machines run several test processes at once), Ray's
local-cluster settings before any test module imports ray (Ray reads them once, at import), so every test file
also runs alone, what the fork server of this test process preloads, and the Ray node that runs share."""

import multiprocessing
import os

import pytest

from slime_hydra.cluster.local_ray import LocalRay, set_local_ray_env
from slime_hydra.config import PROJECT_ROOT

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


ONE_AT_A_TIME = {"slurm", "multinode"}
"""Test directories that pytest-xdist (README's ``-n 2``, with ``--dist=loadgroup``) gives to one worker, one test
after another: tests/slurm's one-node cluster and tests/multinode's two nodes number their jobs from 1, and a job's
Ray temp dirs are named by its id."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Each test module goes to one xdist worker whole (its module-scoped fixtures, engines and models and reference
    runs, are built once, not once per worker), and ONE_AT_A_TIME's directories together to one.

    The groups are handed out in the order of the items (addopts' ``--no-loadscope-reorder``; xdist's own order
    puts the groups of most tests first, which left the single-test runs of tests/loop for last). So the items are
    sorted, longest groups first, as a greedy schedule of jobs over two workers wants them: ONE_AT_A_TIME's group
    (~11 min), then the groups by their ``slow`` tests (~20 s or more each), then by their number of tests; the
    many short groups fill the end, and the two workers finish within a short group of each other."""
    group_of, members = {}, {}
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        one_at_a_time = len(parts) > 2 and parts[0] == "tests" and parts[1] in ONE_AT_A_TIME
        group_of[item] = "slurm" if one_at_a_time else "/".join(parts)
        item.add_marker(pytest.mark.xdist_group(group_of[item]))
        members.setdefault(group_of[item], []).append(item)
    rank = {group: (group != "slurm", -sum(i.get_closest_marker("slow") is not None for i in its), -len(its))
            for group, its in members.items()}
    items.sort(key=lambda item: rank[group_of[item]])  # stable: a group's own order stays


SHARED_NODE_CPUS = 8
"""Logical CPUs of the shared node: the largest run of the tests places 4 role processes; the rest is slack for the
actors of a killed driver while Ray ends them."""


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """SLIME_HYDRA_CACHE of the test session: the tiny model and its warm starts, built once. pytest-xdist's workers
    share it (their base temp dirs sit in the session's); a build is renamed into place whole, so two workers that
    build the same model at once both end with the same complete checkpoint (model/warm_start.py)."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "model_cache")


@pytest.fixture(scope="session")
def shared_ray_node(tmp_path_factory, model_cache):
    """One Ray node (cluster/local_ray.py, as a run starts its own) that runs join through RAY_ADDRESS, as a run in a
    SLURM job joins its allocation's cluster: a run that starts its own node spends ~11 s of wall time and ~14 s of
    CPU on Ray's daemons (docs/benchmarks.md). Its workers get this process's environment, so what a run's
    processes read from theirs is set here: the model cache of the test session and the project on PYTHONPATH (the
    tests' rewards and hooks live in tests/)."""
    saved = {key: os.environ.get(key) for key in ("SLIME_HYDRA_CACHE", "PYTHONPATH")}
    os.environ["SLIME_HYDRA_CACHE"] = model_cache
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), saved["PYTHONPATH"]]))
    node = LocalRay(SHARED_NODE_CPUS, tmp_path_factory.mktemp("shared_ray") / "ray_start.log")
    try:
        node.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield node
    node.stop()


@pytest.fixture
def joined_ray(shared_ray_node, monkeypatch):
    """RAY_ADDRESS of the shared node in this test's environment: the runs it starts join that node."""
    monkeypatch.setenv("RAY_ADDRESS", shared_ray_node.address)
    return shared_ray_node


@pytest.fixture(scope="module")
def ray_driver(shared_ray_node, model_cache):
    """This test process as a Ray driver on the shared node, for the tests of one module, reading the node's model
    cache."""
    import ray

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIME_HYDRA_CACHE", model_cache)
        ray.init(address=shared_ray_node.address, log_to_driver=False)
        yield shared_ray_node
        ray.shutdown()
