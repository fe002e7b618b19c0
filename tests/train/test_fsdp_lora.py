"""train=fsdp with train.lora (PEFT) on CPU: step 0 is the base model bitwise, the reference is the base with the
adapter off, only the adapters train, merged weights and the PEFT directory reproduce the policy, checkpoints hold
the adapter alone and resume exactly (one rank and FSDP over two)."""

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from slime_hydra.train.config import LoraConfig, TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from slime_hydra.weight_transport import split_adapter_key
from tests.train.harness import TINY, hf_response_logprobs, pg_loss, run_ranks, tiny_checkpoint, toy_batch

LORA = LoraConfig(rank=4, alpha=8.0)
CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0, micro_batch_samples=4)


def _gates(rank, world, path, out):
    batch = toy_batch()
    base = FSDPBackend(path, TrainConfig(**CFG), total_steps=2).logprobs(batch)[0]
    backend = FSDPBackend(path, TrainConfig(**CFG, lora=LORA), total_steps=2, keep_reference=True)
    step0, ref0 = backend.logprobs(batch)[0], backend.logprobs(batch, policy="ref")[0]
    trained = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    in_optimizer = sum(len(g["params"]) for g in backend.optimizer.param_groups)
    losses = [float(backend.train_step(batch, pg_loss)["pg_loss"]) for _ in range(2)]
    frozen_grads = [n for n, p in backend.model.named_parameters() if not p.requires_grad and p.grad is not None]
    after, ref1 = backend.logprobs(batch)[0], backend.logprobs(batch, policy="ref")[0]
    merged = dict(backend.iter_full_weights())
    adapter = dict(backend.iter_adapter_weights())
    backend.export_adapter(out / "adapter")
    backend.export_hf(out / "merged")
    return dict(base=base, step0=step0, ref0=ref0, after=after, ref1=ref1, trained=trained, losses=losses,
                in_optimizer=in_optimizer, frozen_grads=frozen_grads, merged=merged, adapter=adapter)


def test_lora_step0_is_the_base_model_and_only_adapters_train(tmp_path):
    path = tiny_checkpoint()
    r = run_ranks(1, _gates, path, tmp_path)[0]
    assert torch.equal(r["step0"], r["base"])  # B = 0: W x + s B A x == W x bitwise
    assert torch.equal(r["ref0"], r["base"]) and torch.equal(r["ref1"], r["base"])  # the adapter switched off
    assert (r["after"] - r["base"]).abs().max() > 1e-3  # the adapters moved the policy
    modules = TINY.num_layers * len(LORA.target_modules)
    assert len(r["trained"]) == 2 * modules and all(".lora_" in n for n in r["trained"])
    assert r["in_optimizer"] == 2 * modules  # Adam state for A and B only
    assert r["frozen_grads"] == []
    assert r["losses"][1] < r["losses"][0]

    # the adapter under PEFT's saved keys; merged weights and both exports reproduce the trained policy (1e-5)
    assert len(r["adapter"]) == 2 * modules and all(split_adapter_key(k) for k in r["adapter"])
    batch = toy_batch()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert set(r["merged"]) == set(hf.state_dict())
    hf.load_state_dict(r["merged"])
    torch.testing.assert_close(hf_response_logprobs(hf, batch), r["after"], atol=1e-5, rtol=0)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                           tmp_path / "adapter")
    torch.testing.assert_close(hf_response_logprobs(peft_model, batch), r["after"], atol=1e-5, rtol=0)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(hf_response_logprobs(exported, batch), r["after"], atol=1e-5, rtol=0)
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(r["adapter"])


def _resume(rank, world, path, ckpt, phase):
    backend = FSDPBackend(path, TrainConfig(**CFG, lora=LORA), total_steps=4, keep_reference=True)
    batch = toy_batch().select(list(range(rank, 8, world)))
    losses = []
    if phase == "resume":
        backend.load(ckpt)
    for k in range(2 if phase != "full" else 4):
        losses.append(float(backend.train_step(batch, pg_loss)["pg_loss"]))
    if phase == "first":
        backend.save(ckpt)
    return losses + [backend.step]


@pytest.mark.parametrize("world", [1, 2])  # one rank: PEFT's model as is; two: FSDP2 over it
def test_lora_checkpoint_holds_the_adapter_and_resumes_exactly(tmp_path, world):
    path = tiny_checkpoint()
    full = run_ranks(world, _resume, path, tmp_path / "ckpt", "full")[0]
    first = run_ranks(world, _resume, path, tmp_path / "ckpt", "first")[0]
    resumed = run_ranks(world, _resume, path, tmp_path / "ckpt", "resume")[0]
    assert first[:2] == full[:2] and resumed == full[2:]  # bitwise, step counter 4
    saved = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 2 * TINY.num_layers * len(LORA.target_modules)  # A and B; no frozen base weight
    assert all(".lora_" in k for k in saved if k.startswith(("model.", "optim.state.")))
