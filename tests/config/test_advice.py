"""Warnings that do not stop a launch (config/advice.py): a real model on the demo's task or on the embedded engine
of a multi-GPU site, GPUs the job holds idle."""

from slime_hydra.config.advice import advice
from tests.config.helpers import load

SITE = ("model=qwen2_5_0_5b", "model.path=/ckpt", "cluster=slurm_8xh100", "rollout.max_response_tokens=1024")


def warned(*overrides: str) -> list[str]:
    return [str(p) for p in advice(*load(*overrides))]


def test_a_real_model_on_the_demo_task_the_embedded_engine_and_idle_gpus_are_named():
    demo, embedded, idle = warned(*SITE)
    assert "[data.task, model.path]" in demo and "data.task=addition is the CPU demo's" in demo
    assert "[rollout.backend, model.path]" in embedded and "a site of 8 GPUs a node" in embedded
    assert "served by rollout.backend=embedded (the default)" in embedded and "add rollout=sglang" in embedded
    assert "train.num_gpus=1 + rollout.num_gpus=1 = 2 of the 8 GPUs the job holds (1 node(s) x 8): 6 idle" in idle
    assert "rollout.num_gpus=7" in idle


def test_a_config_that_uses_its_node_and_real_data_is_not_warned():
    assert warned(*SITE, "data=gsm8k", "rollout=sglang", "rollout.num_gpus=7") == []
    assert warned() == []  # the CPU default: no GPUs to leave idle, the tiny model is built for the demo task
