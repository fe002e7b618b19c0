"""model=tiny_moe (Qwen3-MoE layers: 8 routed experts, 2 per token) end to end through launch.py, on train=fsdp
(transformers' modeling, FSDP2 over the experts too) and train=megatron (megatron-core's MoE layer), with the
embedded engine: the KL to the reference is 0 at step 0,
the engine's logprobs match the trainer's after every sync (the dense gate), the weight sync carries every
expert, and a checkpoint's HF export reproduces the engine's logprobs of the rollout its policy generated. The megatron run replays the engine's routing (algo.routing_replay): every saved sample carries the experts
of each position the engine ran."""

import json

import pytest

from slime_hydra.export import export_checkpoint
from tests.loop.test_loop import SMALL, launch, rollout_logprob_gap, train_rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend, replay", [("fsdp", False), ("megatron", True)])
def test_moe_run_keeps_engine_and_trainer_together(tmp_path, backend, replay):
    from slime_hydra import routed_experts
    from slime_hydra.config import compose, to_config
    from slime_hydra.model.hf import hf_config
    from transformers import AutoModelForCausalLM

    out = launch(f"output_dir={tmp_path}", "run_name=r", "model=tiny_moe", f"train={backend}", "num_steps=3",
                 "algo.kl_loss_coef=0.001", f"algo.routing_replay={str(replay).lower()}", "debug.save_rollouts=true",
                 "save_every_steps=1", *SMALL)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/kl_loss"] == pytest.approx(0, abs=1e-7) and rows[2]["train/kl_loss"] > 0
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5, r
    model = AutoModelForCausalLM.from_config(hf_config(to_config(compose(["model=tiny_moe"])).model))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 4 * 8 * 3 * 128 * 96  # layers x experts x (gate, up, down) x hidden x expert width
    assert all(r["sync/bytes"] == sum(t.numel() for t in model.state_dict().values()) * 4 for r in rows)
    samples = [json.loads(line) for f in sorted((tmp_path / "r" / "rollouts").glob("step_*.jsonl"))
               for line in f.read_text().splitlines()]
    assert len(samples) == 3 * 16
    for sample in samples:
        if replay:  # 4 layers x top-2, one row per position run: prompt + response - 1
            experts = routed_experts.decode(sample["routed_experts"], 4, 2)
            assert experts.shape[0] == len(sample["tokens"]) - 1 and (experts >= 0).all() and (experts < 8).all()
        else:
            assert sample["routed_experts"] == ""
    # the trained MoE comes out of either backend's checkpoints: checkpoint 2's policy generated step 3's rollout
    run = tmp_path / "r"
    assert (run / "export" / "step_000003" / "model.safetensors").is_file()
    gap, tokens = rollout_logprob_gap(export_checkpoint(run, step=2), run / "rollouts" / "step_000003.jsonl")
    assert tokens >= 16 and gap < 1e-5
