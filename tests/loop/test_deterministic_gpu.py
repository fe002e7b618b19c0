"""deterministic=true on one GPU (python3 -m pytest -m gpu tests/loop/test_deterministic_gpu.py): the same command run
twice through launch.py, trainer and batch-invariant engine colocated on the GPU in bf16 (algo.true_on_policy, the
trainer with torch's deterministic algorithms: ``TrainRank.setup``), writes the same metrics.jsonl, times, speeds
and memory peaks aside (the CPU's case: tests/loop/test_checkpoint_in_background.py). Three steps, an eval after
step 2."""

import pytest
import torch

from tests.loop.test_checkpoint_in_background import _repeatable
from tests.loop.test_loop import SHAPE, launch, metrics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ON_ONE_GPU = ("cluster.gpus_per_node=1", "train.num_gpus=1", "cluster.colocate=true", "rollout.num_gpus=null",
              "train.dtype=bf16", "train.lr=1e-3")


@pytest.fixture(scope="module", params=["fsdp", "megatron"])
def runs(request, tmp_path_factory, shared_ray_node, model_cache) -> list[list[dict]]:
    """The metrics rows of two runs of one command (train=fsdp, or train=megatron at TP1), without times, speeds and
    memory peaks."""
    out_dir, rows = tmp_path_factory.mktemp("twice"), []
    with pytest.MonkeyPatch.context() as patch:  # the loop tests' environment (tests/loop/conftest.py), for a module
        patch.setenv("SLIME_HYDRA_CACHE", model_cache)
        patch.setenv("RAY_ADDRESS", shared_ray_node.address)
        for name in ("first", "second"):
            out = launch(f"output_dir={out_dir}", f"run_name={name}", "num_steps=3", "rollout.eval_every_steps=2",
                         "deterministic=true", "algo.true_on_policy=true", f"train={request.param}", *ON_ONE_GPU,
                         *SHAPE, timeout=600)
            assert out.returncode == 0, out.stderr[-4000:]
            rows.append([_repeatable(row) for row in metrics(out_dir / name)])
    return rows


def _trained(rows: list[dict]) -> list[dict]:
    return [row for row in rows if "train/train_rollout_logprob_abs_diff" in row]


def test_the_same_command_twice_writes_the_same_metrics(runs):
    first, second = runs
    assert [row["step"] for row in _trained(first)] == [1, 2, 3]
    assert any(key.startswith("eval/") for row in first for key in row)  # the eval stream repeats too
    assert len({row["train/grad_norm"] for row in _trained(first)}) == 3  # it trained: each step's gradient its own
    different = [(i, key) for i, (a, b) in enumerate(zip(first, second)) for key in a.keys() | b.keys()
                 if a.get(key) != b.get(key)]
    assert len(first) == len(second) and not different, different[:20]


def test_every_step_is_truly_on_policy(runs):
    """Until the trainer's forward ran the engine's kernels (invariant.engine_kernels), torch's deterministic
    algorithms made step 3 miss by 0.0019 nats in one group of four."""
    assert [row["train/train_rollout_logprob_abs_diff_max"] for row in _trained(runs[0])] == [0.0] * 3
