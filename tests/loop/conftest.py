"""The loop tests' runs: the model cache of the test session, and the shared Ray node (tests/conftest.py) for every
run except those of a test marked ``own_ray_node``, which tests what a run's own node does (its session, its end
with the driver, the death of its daemons) or sets an environment variable for the run's workers."""

import pytest


@pytest.fixture(autouse=True)
def _run_environment(request, model_cache, monkeypatch):
    monkeypatch.setenv("SLIME_HYDRA_CACHE", model_cache)
    if request.node.get_closest_marker("own_ray_node") is None:
        request.getfixturevalue("joined_ray")
