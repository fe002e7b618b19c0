"""train.cuda_graphs on a GPU (python3 -m pytest -m gpu tests/train/test_cuda_graphs_gpu.py): the compiled decoder
layers replayed as CUDA graphs train and score exactly as the same compiled layers without graphs, on both
backends, with micro-batches of two shapes (a graph is recorded per shape)."""

import pytest
import torch

from slime_hydra.train.config import TrainConfig
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _with_and_without_graphs(rank, world, path, name):
    """Three steps and the logprobs of two backends built alike but for train.cuda_graphs, taking turns; with
    inductor's CUDA-graph counters (recorded inputs, skipped graphs) after each."""
    from torch._dynamo.utils import counters

    if name == "megatron":
        from slime_hydra.train.megatron.backend import MegatronBackend as Backend
    else:
        from slime_hydra.train.fsdp import FSDPBackend as Backend
    batch = toy_batch()
    out = {}
    for graphs in (False, True):
        train = TrainConfig(lr=1e-2, dtype="bf16", clip_grad=1.0, micro_batch_samples=5, compile=True,
                            cuda_graphs=graphs)
        backend = Backend(path, train, total_steps=3)
        steps = [backend.train_step(batch, pg_loss) for _ in range(3)]
        logp = backend.logprobs(batch)[0]
        out[graphs] = ([(float(m["pg_loss"]), m["grad_norm"]) for m in steps], logp,
                       counters["inductor"]["cudagraph_recorded_non_static_inputs"],
                       counters["inductor"]["cudagraph_skips"])
    return out


@pytest.mark.parametrize("name", ["fsdp", "megatron"])
def test_cuda_graphs_give_the_same_steps_and_logprobs(name):
    out = run_ranks(1, _with_and_without_graphs, tiny_checkpoint(), name)[0]
    plain, graphs = out[False], out[True]
    assert plain[2] == 0 and graphs[2] > 0  # graphs were recorded only with train.cuda_graphs
    assert graphs[3] == plain[3] == 0  # and none was skipped
    for (loss, norm), (want_loss, want_norm) in zip(graphs[0], plain[0]):
        assert abs(loss - want_loss) <= 1e-3 * abs(want_loss) and abs(norm - want_norm) <= 1e-3 * want_norm
    torch.testing.assert_close(graphs[1], plain[1], atol=1e-3, rtol=0)
    assert plain[0][2][0] < plain[0][0][0]  # the loss falls: the steps do train
