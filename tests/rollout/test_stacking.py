"""Stacked sibling projections (stacking.py): same function, same names, in-place updates reach the stacked weights."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from slime_hydra.rollout.engines.embedded import stacking
from slime_hydra.rollout.engines.embedded.memory import place

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def build(kind: str):
    torch.manual_seed(0)
    if kind == "qwen2":  # biases on q, k and v
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE)).eval()
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_stacked_model_computes_the_same_logits_under_the_same_names(kind):
    plain = build(kind)
    stacked = copy.deepcopy(plain)
    parents = stacking.stack(stacked)
    assert len(parents) == 4  # two attention blocks and two MLPs
    assert stacked.state_dict().keys() == plain.state_dict().keys()
    attention = stacked.model.layers[0].self_attn
    assert attention.stacked_weight.shape == (32 + 2 * 16, 32)
    assert (attention.stacked_bias is not None) == (kind == "qwen2")
    ids = torch.randint(0, 64, (3, 10))
    with torch.no_grad():
        assert torch.allclose(stacked(ids).logits, plain(ids).logits, atol=1e-5)

    # An update copies into the parameters in place (Weights.load): it lands in the stacked weights.
    with torch.no_grad():
        for model in (plain, stacked):
            for name, tensor in model.state_dict(keep_vars=True).items():
                if name.endswith(("k_proj.weight", "up_proj.weight")):
                    tensor.copy_(torch.full_like(tensor, 0.01))
        assert torch.allclose(stacked(ids).logits, plain(ids).logits, atol=1e-5)

    # Placed in one allocation (memory.place, as the engine places its weights): views stay views of it.
    place(stacked, torch.device("cpu"))
    whole = attention.stacked_weight.untyped_storage()
    assert all(t.untyped_storage().data_ptr() == whole.data_ptr() for t in (*stacked.parameters(), *stacked.buffers()))
    assert attention.k_proj.weight.data_ptr() == attention.stacked_weight[32:48].data_ptr()
    with torch.no_grad():
        assert torch.allclose(stacked(ids).logits, plain(ids).logits, atol=1e-5)
        attention.k_proj.weight.add_(0.01)  # an update in place still reaches the stacked weight
        assert torch.equal(attention.stacked_weight[32:48], attention.k_proj.weight)


def test_adapted_projections_stay_apart():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("qwen2"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    parents = stacking.stack(model)
    assert [type(p).__name__ for p in parents] == ["Qwen2MLP", "Qwen2MLP"]  # the attention blocks keep theirs
