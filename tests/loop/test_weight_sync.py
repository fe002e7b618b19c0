"""Weight sync, each path: after a training step and a sync, the engine computes the trainer's logprobs exactly.

The engine is asked for the logprobs of a fixed sequence (``/generate`` with max_new_tokens=0 scores the prompt);
equal logprobs to 1e-5 on every token mean the engine holds the trainer's weights (fp32 on CPU). The same numbers
before the sync differ, so the check can fail. The distributed case runs with algo.true_on_policy (both sides
batch-invariant, model/invariant.py): there the logprobs are equal bit for bit, before and after the sync, and the
training step's train/rollout mismatch on the sampled responses is 0.0.
"""

import asyncio
from pathlib import Path

import pytest
import ray

from slime_hydra.config import compose, to_config
from slime_hydra.config.derive import derive
from slime_hydra.loop import Session, init_ray
from slime_hydra.model.warm_start import resolve_model_path
from slime_hydra.tracking.phases import StepTimer
from slime_hydra.rollout.auth import read_api_key
from slime_hydra.rollout.client import SGLangClient
from slime_hydra.train.batch import collate

pytestmark = pytest.mark.slow

SEQUENCE = [2, 90, 88, 74, 87, 100, 22, 23, 16, 24, 25, 34, 3, 100, 2, 70, 26, 27, 1]


def engine_logprobs(url: str, api_key: str) -> tuple[list[float], str, bool]:
    """The engine's logprobs of SEQUENCE, its weight version, and whether it is batch-invariant."""
    async def ask():
        async with SGLangClient(url, api_key=api_key) as client:
            out = await client.generate(SEQUENCE, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
            return ([x[0] for x in out["meta_info"]["input_token_logprobs"][1:]], await client.get_weight_version(),
                    (await client.server_info())["batch_invariant"])
    return asyncio.run(ask())


def trainer_logprobs(session: Session) -> list[float]:
    batch = collate([SEQUENCE], [len(SEQUENCE) - 1], [[1] * (len(SEQUENCE) - 1)], pad_id=0)
    return session.trainer.logprobs(batch)[0][0].tolist()


@pytest.mark.parametrize("overrides", [
    ["train.weight_sync=distributed", "algo.true_on_policy=true"],
    ["train.weight_sync=disk"],
    ["cluster.colocate=true", "rollout.num_gpus=null", "train.weight_sync=tensor"],
], ids=["distributed", "disk", "tensor"])
def test_engine_holds_the_trainer_weights_after_sync(tmp_path, overrides):
    cfg = to_config(compose(["model.sft_warm_start_steps=0", "rollout.batch_prompts=4",
                             "rollout.n_samples_per_prompt=4", "train.micro_batch_samples=16", f"output_dir={tmp_path}", "run_name=r",
                             "train.lr=1e-3", "reward.name=random", *overrides]))  # random rewards: nonzero advantages
    assert init_ray(cfg, tmp_path) is None  # joined the shared node (tests/loop/conftest.py)
    exact = cfg.algo.true_on_policy
    tolerance = 0.0 if exact else 1e-5
    session = Session(cfg, derive(cfg), Path(tmp_path) / "r", resolve_model_path(cfg.model, cfg.data, cfg.seed))
    try:
        url, key = session.engine_urls[0], read_api_key(session.run_dir)
        before, version, invariant = engine_logprobs(url, key)
        assert version == "0" and invariant is exact
        assert max(abs(a - b) for a, b in zip(before, trainer_logprobs(session))) <= tolerance
        samples, _ = session.rollout_phase(0, StepTimer())
        step = session.train_phase(samples, StepTimer())
        if exact:
            assert step["train/train_rollout_logprob_abs_diff"] == step["train/train_rollout_logprob_abs_diff_max"] == 0
        trained = trainer_logprobs(session)
        assert max(abs(a - b) for a, b in zip(before, trained)) > 1e-4     # the step changed the policy
        metrics = session.trainer.push_weights(1)
        after, version, _ = engine_logprobs(url, key)
        assert version == "1" and metrics["sync/bytes"] > 0
        assert max(abs(a - b) for a, b in zip(after, trained)) <= tolerance
    finally:
        session.close()
        ray.shutdown()
