"""train=megatron's experts as grouped matmuls (moe.GroupedExperts) compute what megatron's SequentialMLP loop
computes with the same parameters: outputs and the gradients of the tokens, the routing probabilities and every
expert weight (fp32, CPU), also with an expert that gets no token; the backend builds its MoE layers with them."""

import pytest
import torch

from slime_hydra.train.config import TrainConfig
from tests.rollout.test_routed_experts import moe_checkpoint
from tests.train.harness import run_ranks


def _compare(rank, world, path):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from slime_hydra.train.megatron.backend import MegatronBackend
    from slime_hydra.train.megatron.moe import GroupedExperts

    backend = MegatronBackend(path, TrainConfig(dtype="fp32"), total_steps=1)
    experts = backend.model.decoder.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7, 3])
    x = torch.randn(int(counts.sum()), 64, generator=g)
    probs = torch.rand(int(counts.sum()), generator=g)
    out = {"grouped_class": isinstance(experts, GroupedExperts), "covered": experts._covered()}
    for name, forward in (("grouped", GroupedExperts.forward), ("loop", SequentialMLP.forward)):
        xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        y, bias = forward(experts, xs, counts, ps)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out[name] = {"y": y.detach(), "x": xs.grad, "p": ps.grad,
                     "w": {n: p.grad.clone() for n, p in experts.named_parameters()}}
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_ranks(1, _compare, moe_checkpoint(tmp_path_factory.mktemp("grouped") / "model"))[0]


def test_grouped_experts_equal_megatrons_loop(result):
    assert result["grouped_class"] and result["covered"]
    grouped, loop = result["grouped"], result["loop"]
    for key in ("y", "x", "p"):
        torch.testing.assert_close(grouped[key], loop[key], atol=1e-6, rtol=1e-5)
    assert loop["w"].keys() == grouped["w"].keys()
    for name, grad in loop["w"].items():
        torch.testing.assert_close(grouped["w"][name], grad, atol=1e-6, rtol=1e-5)
    assert not loop["w"]["local_experts.1.linear_fc1.weight"].any()  # the expert without tokens
