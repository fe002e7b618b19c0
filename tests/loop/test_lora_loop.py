"""train.lora end to end through launch.py, for both sync kinds: the KL to the reference (the base model, adapter
off) is 0 at step 0, the engine's logprobs match the trainer's after every sync, an adapter sync moves only A and B
(in fp32) and a merged one the whole model, and the checkpoint holds the adapter alone. The adapter goes by broadcast
(in place) and by disk, where the engines take it through SGLang's LoRA protocol (/load_lora_adapter, lora_path on
every /generate, /unload_lora_adapter of the one before): what SGLang servers are sent."""

import json

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.loop.test_loop import SMALL, launch, train_rows

LORA = ("train.lora.rank=8", "train.lora.target_modules=[q_proj,v_proj,down_proj]", "algo.kl_loss_coef=0.001",
        "checkpoint_in_background=false")

pytestmark = pytest.mark.slow


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


def _exported_logits(export):
    """Logits of a fixed token row under the merged export and under its base with the exported PEFT adapter (the
    base: the run's starting checkpoint, from run.json)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((export.parents[1] / "run.json").read_text())["model_path"]
    ids = torch.tensor([[3, 17, 40, 22, 9, 61, 5, 12]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)(ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                         export / "adapter")
        return merged, peft(ids).logits


@pytest.mark.parametrize("sync, transport", [("adapter", "auto"), ("adapter", "disk"), ("merged", "auto")])
def test_lora_run_keeps_engine_and_trainer_together(tmp_path, sync, transport):
    run = tmp_path / "r"
    out = launch(f"output_dir={tmp_path}", "run_name=r", "num_steps=3", f"train.lora.sync={sync}",
                 f"train.weight_sync={transport}", *LORA, *SMALL)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/kl_loss"] == 0.0  # B = 0: the policy is the reference at step 1, exactly
    assert rows[2]["train/kl_loss"] > 0.0
    for r in rows:  # the engine sampled from the policy the trainer scores (the dense gate)
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-5, r
    sizes = _tiny_sizes()
    expected = sizes["adapter" if sync == "adapter" else "full"]
    if transport == "disk":  # the file's bytes: the tensors and safetensors' JSON header (a few KB)
        assert all(expected < r["sync/bytes"] < expected + 16384 for r in rows), [r["sync/bytes"] for r in rows]
    else:
        assert all(r["sync/bytes"] == expected for r in rows)
    # the final policy comes out merged and as a PEFT adapter; the base plus the adapter is the merged model
    final = run / "export" / "step_000003"
    merged, adapted = _exported_logits(final)
    assert (merged - adapted).abs().max() < 1e-5
    saved = FileSystemReader(str(run / "checkpoints" / "step_000003" / "actor" / "dcp")).read_metadata()
    model_keys = [k for k in saved.state_dict_metadata if k.startswith("model.")]
    assert len(model_keys) == 2 * 3 * sizes["layers"] and all(".lora_" in k for k in model_keys)
    if transport == "disk":  # named adapters: each sync loaded the next and unloaded the one two before
        log = [line.split("LoRA adapter ")[1] for line in (run / "logs" / "engine_0.log").read_text().splitlines()
               if "LoRA adapter " in line]
        assert [line.split()[0] for line in log if " loaded from " in line] == ["policy_v1", "policy_v2", "policy_v3"]
        assert [line for line in log if line.endswith("unloaded")] == ["policy_v1 unloaded"]
        assert [p.name for p in (run / "weights").iterdir()] == ["adapter_v3"]
