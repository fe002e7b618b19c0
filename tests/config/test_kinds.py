"""Pluggable kinds are one record each: a model family, an engine kind or a train backend added by one
``register(...)`` is a valid choice, and validation, the memory plan and building ask its record (model/families.py,
rollout/engines/kinds.py, train/kinds.py)."""

import json

import pytest

from slime_hydra.config import collect_problems, compose, to_config
from slime_hydra.config.files import check_files
from slime_hydra.config.memory import plan_memory
from slime_hydra.model.families import FAMILIES, Family, register
from slime_hydra.model.tiny import build_tiny_tokenizer
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS, EngineKind
from slime_hydra.rollout.engines.kinds import register as register_engine
from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS, TrainBackendKind
from slime_hydra.train.kinds import register as register_backend

MISTRAL = ("model.family=mistral", "model.path=null")


@pytest.fixture
def mistral():
    """A throwaway family: Mistral's layout (Llama's, no biases), trained by fsdp only, served by every engine."""
    register(Family("mistral", "MistralConfig", "transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding",
                    backends=("fsdp",)))
    yield FAMILIES["mistral"]
    del FAMILIES["mistral"]


def _problems(*overrides):
    return [str(p) for p in collect_problems(to_config(compose(list(overrides))))[0]]


def test_a_family_added_by_one_record_is_validated_planned_and_built(mistral, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_hydra.model.hf import build_random_checkpoint

    assert any("did you mean model.family=mistral?" in p for p in _problems("model.family=mistrel"))  # live domain
    cfg = to_config(compose(list(MISTRAL)))
    problems, derived = collect_problems(cfg)
    assert problems == []  # validated: the tiny model's numbers as a Mistral
    plan = plan_memory(cfg, derived)  # planned: the memory plan counts it as the tiny qwen2 it is shaped like
    tiny = to_config(compose([]))
    assert plan.host.total == plan_memory(tiny, collect_problems(tiny)[1]).host.total > 0
    refused = _problems(*MISTRAL, "train=megatron")
    assert any("train=megatron does not train model.family=mistral" in p and "use train=fsdp" in p for p in refused)

    path = build_random_checkpoint(cfg.model, tmp_path / "m")  # built, from the record's config class and fields
    hf = AutoConfig.from_pretrained(path)
    assert hf.model_type == "mistral" and hf.num_hidden_layers == cfg.model.num_layers
    assert AutoModelForCausalLM.from_pretrained(path).num_parameters() > 0
    build_tiny_tokenizer().save_pretrained(path)  # the files check wants a tokenizer that loads
    good = to_config(compose([*MISTRAL, f"model.path={path}"]))
    assert list(check_files(good)) == []  # its config.json agrees with the option, field by field (the record's map)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    assert [p.keys for p in check_files(good)] == [("model.num_kv_heads",)]


def test_an_engine_kind_and_a_train_backend_added_by_one_record_are_asked_by_the_rules():
    register_engine(EngineKind("vllm", "vLLM servers", weight_syncs=("distributed", "disk"), colocated_sync="disk",
                               adapters="directory", routed_experts=False, memory="fraction",
                               max_gpus_per_engine=None, needs_gpu=True))
    register_backend(TrainBackendKind("ddp", "torch.nn.parallel.DistributedDataParallel", parallelism=(),
                                      sharding="fully_sharded", checkpoint_slots="any", packing=False, lora=True,
                                      moe=False))
    try:
        cpu = _problems("rollout.backend=vllm", "train.backend=ddp")
        assert any("rollout=vllm needs GPUs" in p for p in cpu)
        assert not any("train.backend" in p and "not one of" in p for p in cpu)  # a valid choice now
        # the family records name the kinds that run them: the new ones run none yet
        assert any("rollout=vllm does not serve model.family=qwen2" in p for p in cpu)
        assert any("train=ddp does not train model.family=qwen2" in p for p in cpu)
        tp = _problems("train.backend=ddp", "train.num_gpus=2", "train.tp=2")
        assert any("train=ddp does not split a model replica by tp=2" in p and "use train=megatron" in p for p in tp)
        packed = _problems("train.backend=ddp", "train.pack_sequences=true", "model=tiny_moe")
        assert any("train=ddp does not train with train.pack_sequences=true" in p
                   and "use train=fsdp, or set train.pack_sequences=false" in p for p in packed)
        assert any("train=ddp does not train with model.family=qwen3_moe" in p for p in packed)
        assert not any("train.lora" in p for p in _problems("train.backend=ddp", "train.lora.rank=8"))
    finally:
        del ENGINE_KINDS["vllm"], TRAIN_BACKEND_KINDS["ddp"]
