"""train=megatron with train.lora on CPU (gloo, fp32): the adapters on megatron's fused, TP-split linears compute
PEFT's function (logprobs within 1e-5 of transformers + peft with the same adapter, at TP1 and TP2), step 0 is the
base model bit for bit, TP2 and PP2 train as TP1, training tracks PEFT's, merged weights and the PEFT export are right,
only the adapters train, and a checkpoint resumes exactly (also at PP2).

Three spawned runs (TP1 on one rank, TP2 and PP2 on two) compute everything; the tests assert on their results. The family is
qwen2: q/k/v biases stay frozen beside the adapters (train.lora.bias=none).
"""

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from slime_hydra.train.config import LoraConfig, TrainConfig
from slime_hydra.train.lora import merge, peft_config
from slime_hydra.weight_transport import adapter_key
from slime_hydra.train.megatron.model import Arch
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch

LORA = LoraConfig(rank=4, alpha=16.0)
CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0, micro_batch_samples=8)
STEPS = 3


def hf_logprobs(model, batch) -> torch.Tensor:
    """[B, T] logprobs of each response token under an HF (or PEFT) causal LM, one unpadded row at a time; zero
    past each response (as the backends return them)."""
    out = torch.zeros(batch.loss_mask.shape)
    rows = []
    for i in range(batch.size):
        n, p = int(batch.attention_mask[i].sum()), int(batch.response_start[i])
        ids = batch.input_ids[i, :n].unsqueeze(0)
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        picked = logp[p - 1:n - 1].gather(1, ids[0, p:n].unsqueeze(1)).squeeze(1)
        rows.append(torch.cat((picked, out.new_zeros(batch.loss_mask.shape[1] - (n - p)))))
    return torch.stack(rows)


def peft_model(path, adapter_dir):
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def adapter(path, tmp_path_factory):
    """A PEFT adapter with nonzero A and B (PEFT's own init gives B = 0), saved by PEFT."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), peft_config(LORA))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    out = tmp_path_factory.mktemp("peft_adapter")
    model.save_pretrained(out)
    return out


# ---- ranks' work --------------------------------------------------------------------------------------------
def _steps(backend, batch, n):
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(batch, pg_loss) for _ in range(n))]


def _tp1(rank, world, path, adapter, ckpt, export):
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    base = MegatronBackend(path, TrainConfig(**CFG), total_steps=STEPS)
    out["base_logp"] = base.logprobs(batch)[0]
    out["base_weights"] = dict(base.iter_full_weights())
    train = TrainConfig(**CFG, lora=LORA)
    policy = MegatronBackend(path, train, total_steps=STEPS, keep_reference=True)
    out["step0"] = policy.logprobs(batch)[0], policy.logprobs(batch, "ref")[0]
    policy.load_adapter(adapter)
    out["loaded"] = policy.logprobs(batch)[0], policy.logprobs(batch, "ref")[0]
    out["steps"] = _steps(policy, batch, 2)
    policy.save(ckpt)
    out["steps"] += _steps(policy, batch, 1)
    frozen = [p for n, p in policy.model.named_parameters() if ".lora." not in n]
    optimized = [p for group in policy.optimizer.param_groups for p in group["params"]]
    out["params"] = dict(
        optimized=len(optimized), optimized_numel=sum(p.numel() for p in optimized),
        adapters=len(policy.lora.parameters()), same=set(map(id, optimized)) == set(map(id, policy.lora.parameters())),
        frozen=len(frozen), frozen_trainable=sum(p.requires_grad for p in frozen),
        frozen_grads=sum(p.grad is not None for p in frozen), adam_state=len(policy.optimizer.state))
    out["adapters"] = dict(policy.iter_adapter_weights())
    out["merged"] = dict(policy.iter_full_weights())
    out["after"] = policy.logprobs(batch)[0]
    policy.export_adapter(export)
    resumed = MegatronBackend(path, train, total_steps=STEPS, keep_reference=True)
    resumed.load(ckpt)
    out["resumed"] = _steps(resumed, batch, 1), dict(resumed.iter_adapter_weights())
    return out


def _tp2(rank, world, path, adapter):
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out = toy_batch(), {}
    policy = MegatronBackend(path, TrainConfig(**CFG, tp=2, lora=LORA), total_steps=STEPS)
    out["step0"] = policy.logprobs(batch)[0]
    policy.load_adapter(adapter)
    out["loaded"] = policy.logprobs(batch)[0]
    out["steps"] = _steps(policy, batch, STEPS)
    out["adapters"] = dict(policy.iter_adapter_weights())
    return out


def _pp2(rank, world, path, adapter, ckpt):
    """Two pipeline stages of one layer each: each holds its layer's adapters."""
    from slime_hydra.train.megatron.backend import MegatronBackend

    batch, out, train = toy_batch(), {}, TrainConfig(**CFG, pp=2, lora=LORA)
    policy = MegatronBackend(path, train, total_steps=STEPS, keep_reference=True)
    out["stage_adapters"] = len(policy.lora.parameters())
    out["step0"] = policy.logprobs(batch)[0]
    policy.load_adapter(adapter)
    out["loaded"] = policy.logprobs(batch)[0], policy.logprobs(batch, "ref")[0]
    out["steps"] = _steps(policy, batch, 2)
    policy.save(ckpt)
    out["steps"] += _steps(policy, batch, 1)
    out["adapters"] = dict(policy.iter_adapter_weights())
    out["merged"] = dict(policy.iter_full_weights())
    resumed = MegatronBackend(path, train, total_steps=STEPS, keep_reference=True)
    resumed.load(ckpt)
    out["resumed"] = _steps(resumed, batch, 1)
    return out


@pytest.fixture(scope="module")
def tp1(path, adapter, tmp_path_factory):
    export = tmp_path_factory.mktemp("lora_export")
    return {**run_ranks(1, _tp1, path, adapter, tmp_path_factory.mktemp("lora_ckpt"), export)[0], "export": export}


@pytest.fixture(scope="module")
def tp2(path, adapter):
    return run_ranks(2, _tp2, path, adapter)


@pytest.fixture(scope="module")
def pp2(path, adapter, tmp_path_factory):
    return run_ranks(2, _pp2, path, adapter, tmp_path_factory.mktemp("lora_pp2_ckpt"))


@pytest.fixture(scope="module")
def peft_run(path, adapter):
    """transformers + peft from the same adapter: its logprobs, then STEPS AdamW steps of pg_loss on the same
    batch with the backends' settings (token mean over the batch, clip 1.0, lr 1e-2, betas 0.9/0.98, eps 1e-8)."""
    batch, train = toy_batch(), TrainConfig(**CFG)
    model = peft_model(path, adapter)
    with torch.no_grad():
        loaded = hf_logprobs(model, batch)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                  eps=train.adam_eps, weight_decay=train.weight_decay)
    steps = []
    for _ in range(STEPS):
        loss, _ = pg_loss(hf_logprobs(model, batch), None, batch)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, train.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
        steps.append((float(loss.detach()), float(norm)))
    return loaded, steps


# ---- tests --------------------------------------------------------------------------------------------------
def test_step0_lora_policy_and_reference_are_the_base_model_bit_for_bit(tp1, tp2):
    current, ref = tp1["step0"]
    assert torch.equal(current, tp1["base_logp"]) and torch.equal(ref, tp1["base_logp"])
    torch.testing.assert_close(tp2[0]["step0"], tp1["base_logp"], atol=1e-5, rtol=0)


def test_loaded_adapter_gives_peft_logprobs_at_tp1_and_tp2(tp1, tp2, peft_run):
    loaded, _ = peft_run
    assert (loaded - tp1["base_logp"]).abs().max() > 1e-2  # the adapter changes the policy ...
    for got in (tp1["loaded"][0], tp2[0]["loaded"], tp2[1]["loaded"]):
        assert (got - loaded).abs().max() < 1e-5  # ... exactly as PEFT's does
    assert torch.equal(tp1["loaded"][1], tp1["base_logp"])  # the reference switches the adapter off


def test_tp2_trains_as_tp1(tp1, tp2):
    for (loss1, norm1), (loss2, norm2) in zip(tp1["steps"], tp2[0]["steps"]):
        assert abs(loss2 - loss1) <= 1e-5 * abs(loss1) and abs(norm2 - norm1) <= 1e-5 * norm1
    assert tp2[0]["steps"] == tp2[1]["steps"]
    assert tp2[0]["adapters"].keys() == tp1["adapters"].keys()
    for key, tensor in tp1["adapters"].items():
        assert torch.equal(tp2[0]["adapters"][key], tp2[1]["adapters"][key])
        torch.testing.assert_close(tp2[0]["adapters"][key], tensor, atol=1e-5, rtol=0)


def test_training_tracks_peft_on_the_same_batches(tp1, peft_run):
    _, steps = peft_run  # seen: within 3e-7 relative (fp32); 1e-5 asserted
    for (loss, norm), (peft_loss, peft_norm) in zip(tp1["steps"], steps):
        assert abs(loss - peft_loss) <= 1e-5 * abs(peft_loss)
        assert abs(norm - peft_norm) <= 1e-5 * peft_norm


def test_merged_full_weights_and_the_exported_peft_adapter(tp1, path):
    adapters, base, merged = tp1["adapters"], tp1["base_weights"], tp1["merged"]
    assert merged.keys() == base.keys()
    adapted = 0
    for name, tensor in merged.items():
        module = name[:-len(".weight")]
        if adapter_key(module, "A") in adapters:
            want = merge(base[name], adapters[adapter_key(module, "A")], adapters[adapter_key(module, "B")],
                         LORA.scale)
            adapted += 1
        else:
            want = base[name]
        assert torch.equal(tensor, want), name
    assert adapted == 2 * 7 and len(adapters) == 2 * 2 * 7  # 2 layers x 7 modules, A and B each
    model = peft_model(path, tp1["export"])
    with torch.no_grad():
        assert (hf_logprobs(model, toy_batch()) - tp1["after"]).abs().max() < 1e-5


def test_only_the_adapters_train(tp1):
    count = tp1["params"]
    # per layer: q (A 4x64, B 64x4), k and v (A 4x64, B 32x4), o (A 4x64, B 64x4), gate/up (A 4x64, B 128x4),
    # down (A 4x128, B 64x4)
    assert count["optimized"] == count["adapters"] == 2 * 7 * 2 and count["same"]
    assert count["optimized_numel"] == 2 * (512 + 2 * 384 + 512 + 2 * 768 + 768)
    assert count["adam_state"] == count["optimized"]
    assert count["frozen"] > 0 and count["frozen_trainable"] == 0 and count["frozen_grads"] == 0


def test_checkpoint_resume_reproduces_the_next_step_exactly(tp1):
    steps, adapters = tp1["resumed"]
    assert steps == tp1["steps"][2:]
    assert all(torch.equal(adapters[k], tp1["adapters"][k]) for k in adapters)


def test_pp2_holds_each_stages_adapters_and_trains_as_tp1(tp1, pp2, peft_run):
    """PP2: each stage holds its layer's adapters (7 modules x A, B); step 0 is the base; the loaded adapter gives
    PEFT's logprobs and the reference switches it off; losses and grad norms track TP1's; every stage gets every
    adapter and the merged weights; a checkpoint (one file per stage) resumes exactly."""
    loaded, _ = peft_run
    assert [r["stage_adapters"] for r in pp2] == [2 * 7, 2 * 7]
    for r in pp2:  # the last stage's logprobs, broadcast to every stage
        torch.testing.assert_close(r["step0"], tp1["base_logp"], atol=1e-5, rtol=0)
        assert (r["loaded"][0] - loaded).abs().max() < 1e-5
        torch.testing.assert_close(r["loaded"][1], tp1["base_logp"], atol=1e-5, rtol=0)
    for (loss1, norm1), (loss2, norm2) in zip(tp1["steps"], pp2[0]["steps"]):
        assert abs(loss2 - loss1) <= 1e-5 * abs(loss1) and abs(norm2 - norm1) <= 1e-5 * norm1
    assert pp2[0]["steps"] == pp2[1]["steps"]
    for r in pp2:
        assert r["adapters"].keys() == tp1["adapters"].keys()
        for key, tensor in tp1["adapters"].items():
            torch.testing.assert_close(r["adapters"][key], tensor, atol=1e-5, rtol=0)
        assert r["merged"].keys() == tp1["merged"].keys()
        for name, tensor in tp1["merged"].items():
            torch.testing.assert_close(r["merged"][name], tensor, atol=1e-5, rtol=0)
    assert [r["resumed"] for r in pp2] == [pp2[0]["steps"][2:]] * 2


def _fsdp_then_export(rank, world, path, out):
    """train=fsdp LoRA: export its initial adapter, then three steps' (loss, grad norm)."""
    from slime_hydra.train.fsdp import FSDPBackend

    backend = FSDPBackend(path, TrainConfig(**CFG, lora=LORA), total_steps=STEPS)
    backend.export_adapter(out)
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(toy_batch(), pg_loss)
                                                            for _ in range(STEPS))]


def _megatron_from(rank, world, path, adapter_dir):
    from slime_hydra.train.megatron.backend import MegatronBackend

    backend = MegatronBackend(path, TrainConfig(**CFG, lora=LORA), total_steps=STEPS)
    backend.load_adapter(adapter_dir)
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in (backend.train_step(toy_batch(), pg_loss)
                                                            for _ in range(STEPS))]


def test_fsdp_and_megatron_lora_agree_on_loss_and_grad_norm(path, tmp_path):
    """The two backends from one adapter (fsdp's seeded init, moved through its PEFT export): the same losses and
    grad norms over three steps (the issue's gate is 1%; they agree to 1e-5 relative)."""
    fsdp = run_ranks(1, _fsdp_then_export, path, tmp_path / "init")[0]
    megatron = run_ranks(1, _megatron_from, path, tmp_path / "init")[0]
    for (loss_f, norm_f), (loss_m, norm_m) in zip(fsdp, megatron):
        assert loss_m == pytest.approx(loss_f, rel=1e-5) and norm_m == pytest.approx(norm_f, rel=1e-5)
    assert fsdp[-1][0] < fsdp[0][0]  # it trained
