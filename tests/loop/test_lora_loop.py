"""train.lora end to end through launch.py, for both sync kinds: the KL to the reference (the base model, adapter
off) is 0 at step 0, the engine's logprobs match the trainer's after every sync, an adapter sync moves only A and B
(in fp32) and a merged one the whole model, and the checkpoint holds the adapter alone."""

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.loop.test_loop import SMALL, launch, train_rows

LORA = ("train.lora.rank=8", "train.lora.target_modules=[q_proj,v_proj,down_proj]", "algo.kl_loss_coef=0.001",
        "checkpoint_in_background=false")

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SLIME_HYDRA_CACHE", str(tmp_path_factory.getbasetemp() / "model_cache"))


def _tiny_sizes() -> dict[str, int]:
    """model=tiny's layers; fp32 bytes of its whole state dict and of a rank-8 adapter on q, v and down."""
    from slime_hydra.config import compose, to_config
    from slime_hydra.model.hf import hf_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(to_config(compose([])).model))
    full = sum(t.numel() for t in model.state_dict().values()) * 4
    c = model.config
    head = c.hidden_size // c.num_attention_heads
    per_layer = (c.hidden_size + c.num_attention_heads * head) + (c.hidden_size + c.num_key_value_heads * head) + (
        c.intermediate_size + c.hidden_size)  # r * (in + out) per adapted module
    return {"full": full, "adapter": 8 * per_layer * c.num_hidden_layers * 4, "layers": c.num_hidden_layers}


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_run_keeps_engine_and_trainer_together(tmp_path, sync):
    run = tmp_path / "r"
    out = launch(f"output_dir={tmp_path}", "run_name=r", "num_steps=3", f"train.lora.sync={sync}", *LORA, *SMALL)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["train/kl_loss"] == 0.0  # B = 0: the policy is the reference at step 0, exactly
    assert rows[2]["train/kl_loss"] > 0.0
    for r in rows:  # the engine sampled from the policy the trainer scores (the dense gate)
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5, r
    sizes = _tiny_sizes()
    assert all(r["sync/bytes"] == sizes["adapter" if sync == "adapter" else "full"] for r in rows)
    saved = FileSystemReader(str(run / "checkpoints" / "step_000003" / "actor" / "dcp")).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert len(model_keys) == 2 * 3 * sizes["layers"] and all(".lora_" in k for k in model_keys)
