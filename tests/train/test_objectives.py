"""The algo configs' losses on the real FSDP backend: step-0 gates and a GRPO step that follows the advantages."""

from slime_hydra.algo.config import AlgoConfig
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.fsdp import FSDPBackend
from slime_hydra.train.objectives import ActorLoss
from tests.train.harness import run_ranks, tiny_checkpoint, toy_batch


def _grpo_first_steps(rank, world, path, algo):
    backend = FSDPBackend(path, TrainConfig(lr=1e-2, dtype="fp32", micro_batch_samples=4), total_steps=2,
                          keep_reference=True)
    batch = toy_batch()
    old, _ = backend.logprobs(batch)
    ref, _ = backend.logprobs(batch, "ref")
    batch.extras.update(old_logprobs=old, ref_logprobs=ref, rollout_logprobs=old)
    loss = ActorLoss(algo, max_response_tokens=8)
    first = backend.train_step(batch, loss, with_entropy=True)
    second = backend.train_step(batch, loss, with_entropy=True)
    new, _ = backend.logprobs(batch)
    return first, second, old, new, batch.extras["advantages"], batch.loss_mask


def test_step0_gates_and_policy_moves_along_the_advantages():
    algo = AlgoConfig(kl_loss_coef=0.01, entropy_coef=0.001, tis_cap=2.0)
    first, second, old, new, adv, mask = run_ranks(2, _grpo_first_steps, tiny_checkpoint(), algo)[0]
    # step 0: trainer == old == reference policy, so the ratio is 1 everywhere
    assert first["ppo_kl"] == 0 and first["pg_clipfrac"] == 0 and first["kl_loss"] == 0
    assert first["tis"] == 1 and first["tis_clipfrac"] == 0
    assert first["entropy_loss"] > 0
    # second step sees the moved policy: a nonzero ratio and KL
    assert second["ppo_kl"] != 0 and second["kl_loss"] > 0
    # tokens with positive advantage became more likely, negative less likely (on average)
    delta = (new - old) * mask
    assert delta[adv > 0].mean() > 0 > delta[adv < 0].mean()
