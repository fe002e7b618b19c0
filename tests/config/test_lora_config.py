"""train.lora at validation: what a backend, the model family or the engines cannot honour is refused before
anything starts, naming the keys; what they can is planned."""

import pytest

from slime_hydra.options import ConfigError
from tests.config.helpers import load, problems

LORA = ("train.lora.rank=8",)
MEGATRON = (*LORA, "train=megatron")
SGLANG = (*LORA, "rollout=sglang", "cluster.gpus_per_node=8", "model=qwen2_5_0_5b", "model.path=/ckpt/q",
          "rollout.num_gpus=1")


@pytest.mark.parametrize("overrides, keys, words", [
    ((*LORA, "train.lora.target_modules=[q_proj,qproj]"), "[train.lora.target_modules.1]", "not a decoder linear"),
    ((*LORA, "train.lora.target_modules=[]"), "[train.lora.target_modules]", "adapts nothing"),
    ((*LORA, "train.lora.sync=adapter", "train.lora.bias=all"), "[train.lora.sync, train.lora.bias]",
     "does not carry"),
    ((*SGLANG, "train.lora.sync=adapter", "train.weight_sync=distributed"),
     "[train.lora.sync, train.weight_sync, rollout.backend]", "a directory they load (/load_lora_adapter)"),
    ((*SGLANG, "+rollout.sglang.max_lora_rank=64"), "[rollout.sglang.max_lora_rank]", "train.lora.rank"),
    ((*LORA, "model=tiny_moe"), "[train.lora.target_modules, model.family]", "fused [experts, ...] tensors"),
    ((*LORA, "model=glm4_9b", "cluster=slurm_8xh100", "model.path=/ckpt/glm4"),
     "[train.lora.target_modules, model.family]", "gate_up_proj"),
    ((*MEGATRON, "train.num_gpus=2", "train.tp=2", "train.lora.dropout=0.1"), "[train.lora.dropout, train.tp]",
     "dropout mask"),
    ((*MEGATRON, "train.num_gpus=4", "train.tp=4", "model.num_kv_heads=2"),
     "[train.lora.target_modules, train.tp]", "whole query groups"),
    ((*MEGATRON, "train.lora.bias=lora_only", "train.lora.target_modules=[q_proj,v_proj]"),
     "[train.lora.bias, train.lora.target_modules]", "fused q/k/v bias"),
    ((*MEGATRON, "train.num_gpus=2", "train.tp=2", "+train.megatron.sequence_parallel=true"),
     "[train.lora.rank, train.megatron.sequence_parallel]", "full sequence"),
])
def test_what_lora_cannot_do_is_refused_naming_the_keys(overrides, keys, words):
    error = problems(*overrides)
    assert any(keys in str(p) and words in str(p) for p in error.problems), error


def test_what_lora_can_do_validates():
    assert load(*LORA)[1].lora_sync == "adapter"  # separate embedded engines apply adapters
    assert load(*LORA, "cluster.colocate=true")[1].lora_sync == "merged"  # a device copy; the engine runs faster
    assert load(*LORA, "cluster.colocate=true", "train.lora.sync=adapter")[1].lora_sync == "adapter"
    assert load(*LORA, "train.lora.bias=all")[1].lora_sync == "merged"  # trained biases travel merged
    assert load(*MEGATRON, "train.num_gpus=2", "train.tp=2")[1].lora_sync == "adapter"
    assert load(*MEGATRON, "train.num_gpus=2", "train.pp=2")[1].lora_sync == "adapter"
    assert load(*MEGATRON, "model=tiny_moe", "train.lora.target_modules=[q_proj,o_proj]")[1].lora_sync == "adapter"
    assert load(*LORA, "model=tiny_moe", "train.lora.target_modules=[q_proj,o_proj]")[1].lora_sync == "adapter"
    sglang = load(*SGLANG)[1]  # merged weights by a broadcast: SGLang then decodes the plain model
    assert (sglang.lora_sync, sglang.weight_sync) == ("merged", "distributed")
    sglang = load(*SGLANG, "train.lora.sync=adapter")[1]  # SGLang takes adapters from a directory
    assert (sglang.lora_sync, sglang.weight_sync) == ("adapter", "disk")
    assert load(*LORA, "model=glm4_9b", "cluster=slurm_8xh100", "model.path=/ckpt/glm4",
                "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,down_proj]")[0].train.lora.rank == 8
    with pytest.raises(ConfigError):
        load("train.lora.rank=-1")
