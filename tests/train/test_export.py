"""export.py: a run's checkpoint out as a Hugging Face checkpoint, for both backends, full and LoRA, from layouts of
several ranks: plain transformers (and PEFT for the adapter) load it and reproduce the trained policy's logprobs.

Each case trains a tiny model two steps on gloo ranks, saves a checkpoint where a run keeps it (with the
resolved.yaml, run.json and ``latest`` a run writes), then exports it in fresh processes (export_checkpoint: the
backend on CPU, weights-only load, the same layout's gathers)."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from slime_hydra.checkpoint import RUN_RECORD, checkpoint_dir, mark_latest
from slime_hydra.durable import write_json
from slime_hydra.config import compose
from slime_hydra.export import export_checkpoint, main
from slime_hydra.train.backend import export_dtype
from slime_hydra.train.config import LoraConfig, TrainConfig
from tests.train.harness import hf_response_logprobs, pg_loss, run_ranks, tiny_checkpoint, toy_batch

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0, micro_batch_samples=4)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
STEP = 2


def _train_and_save(rank, world, backend_name, path, train, ckpt):
    """Two optimizer steps, a checkpoint (as Session.save writes the actor's), the policy's logprobs after them."""
    import importlib

    from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS

    module, name = TRAIN_BACKEND_KINDS[backend_name].cls.rsplit(".", 1)
    backend = getattr(importlib.import_module(module), name)(path, train, total_steps=4, keep_reference=True)
    batch = toy_batch()
    for _ in range(STEP):
        backend.train_step(batch, pg_loss)
    backend.save(ckpt)
    return backend.logprobs(batch)[0]


def _fake_run(run: Path, model_path: Path, overrides: list[str]) -> Path:
    """A run directory as launch.py and loop.py leave one: resolved.yaml, run.json (its model path), a checkpoint of
    step STEP with loop.json, ``latest`` pointing at it. Returns the checkpoint's actor directory."""
    run.mkdir(parents=True)
    (run / "resolved.yaml").write_text(OmegaConf.to_yaml(compose(overrides), resolve=True))
    write_json(run / RUN_RECORD, {"outcome": "done", "model_path": str(model_path)})
    ckpt = checkpoint_dir(run, STEP)
    (ckpt / "actor").mkdir(parents=True)
    write_json(ckpt / "loop.json", {"step": STEP, "rollouts_ahead": []})
    mark_latest(run, ckpt)
    return ckpt / "actor"


CASES = {  # name: (backend, ranks that train, TrainConfig fields, config overrides of the run)
    "fsdp_dp2": ("fsdp", 2, {}, ["train.num_gpus=2"]),
    "fsdp_lora": ("fsdp", 1, {"lora": LORA}, ["train.lora.rank=4", "train.lora.alpha=8",
                                              "train.lora.target_modules=[q_proj,v_proj,down_proj]"]),
    "megatron_tp2": ("megatron", 2, {"tp": 2}, ["train=megatron", "train.num_gpus=2", "train.tp=2"]),
    "megatron_pp2_dp2": ("megatron", 4, {"pp": 2}, ["train=megatron", "train.num_gpus=4", "train.pp=2"]),
    "megatron_lora_tp2": ("megatron", 2, {"tp": 2, "lora": LORA},
                          ["train=megatron", "train.num_gpus=2", "train.tp=2", "train.lora.rank=4",
                           "train.lora.alpha=8", "train.lora.target_modules=[q_proj,v_proj,down_proj]"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_exported_checkpoint_reproduces_the_trained_policy(tmp_path, case):
    backend, world, fields, overrides = CASES[case]
    path = tiny_checkpoint()
    run = tmp_path / "run"
    actor = _fake_run(run, path, [f"train.{k}={v}" for k, v in CFG.items()] + overrides)
    trained = run_ranks(world, _train_and_save, backend, path, TrainConfig(**CFG, **fields), actor)[0]

    out = export_checkpoint(run)  # the newest complete checkpoint, into run/export/step_000002
    assert out == run / "export" / f"step_{STEP:06d}"
    batch = toy_batch()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(hf_response_logprobs(exported, batch), trained, atol=1e-5, rtol=0)
    assert (trained - hf_response_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batch)).abs().max() \
        > 1e-3  # the two steps moved the policy away from the starting checkpoint
    if "lora" in fields:
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == LORA.rank
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                            out / "adapter")
        torch.testing.assert_close(hf_response_logprobs(adapted, batch), trained, atol=1e-5, rtol=0)
    else:
        assert not (out / "adapter").exists()


def test_the_export_carries_the_tokenizer_and_the_starting_dtype_and_refuses_missing_checkpoints(tmp_path, capsys):
    """The tiny model's tokenizer comes along byte for byte; a bf16 checkpoint exports bf16; a step that has no
    complete checkpoint is refused naming what there is (exit 2 from the command)."""
    from slime_hydra.model.tiny import build_tiny_tokenizer

    path = tiny_checkpoint()
    build_tiny_tokenizer(str(path))
    run = tmp_path / "run"
    actor = _fake_run(run, path, [f"train.{k}={v}" for k, v in CFG.items()])
    run_ranks(1, _train_and_save, "fsdp", path, TrainConfig(**CFG), actor)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert "exported:" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (path / name).read_bytes()

    config = AutoConfig.from_pretrained(path)
    assert export_dtype(config) == torch.float32
    config.dtype = "bfloat16"
    assert export_dtype(config) == torch.bfloat16

    assert main([str(run), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint at step 7" in err and "step_000002" in err
    assert main([str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
