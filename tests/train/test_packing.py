"""Padding-free micro-batches (train.pack_sequences, train/packing.py): the packed layout, token-balanced groups, and
both backends computing on packed rows exactly what they compute on padded ones (CPU, gloo, fp32)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from slime_hydra.train.batch import collate, packed_micro_batches, split_to_count
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.packing import pack, packed_attention
from tests.train.harness import pg_loss, run_ranks, tiny_checkpoint, toy_batch
from tests.train.test_megatron_moe import moe_checkpoint

CFG = dict(lr=1e-2, dtype="fp32", clip_grad=1.0)


def test_pack_lays_samples_back_to_back_and_keeps_the_predicting_positions():
    # sample 0: prompt [5, 6], response [7, 8, 9]; sample 1: prompt [1, 2, 3], response [4]
    mb = collate([[5, 6, 7, 8, 9], [1, 2, 3, 4]], [3, 1], [[1, 1, 1], [1]], pad_id=0)
    packed = pack(mb)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 5, 9] and packed.max_length == 5
    assert packed.keep.tolist() == [1, 2, 3, 7]  # the positions before 7, 8, 9 and before 4
    assert packed.targets.tolist() == [7, 8, 9, 4]
    assert packed.index.tolist() == [[0, 1, 2], [3, 0, 0]]
    assert packed.valid.tolist() == [[True, True, True], [True, False, False]]

    bucketed = pack(mb, bucketed=True)  # train.cuda_graphs: 9 tokens + a filler of 247, 3 sequences + an empty one
    assert bucketed.input_ids.shape == (1, 256) and bucketed.input_ids[0, :9].tolist() == packed.input_ids[0].tolist()
    assert bucketed.position_ids[0, 9:].tolist() == list(range(247))
    assert bucketed.cu_seqlens.tolist() == [0, 5, 9, 256, 256] and bucketed.max_length == 256
    for name in ("keep", "targets", "index", "valid"):
        assert torch.equal(getattr(bucketed, name), getattr(packed, name))


def test_packed_attention_on_cpu_equals_each_sequence_alone():
    torch.manual_seed(0)
    lengths, heads, kv_heads, d = [5, 1, 7], 4, 2, 8
    n = sum(lengths)
    q, k, v = torch.randn(1, heads, n, d), torch.randn(1, kv_heads, n, d), torch.randn(1, kv_heads, n, d)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    out, _ = packed_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=7)
    assert out.shape == (1, n, heads, d)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out[:, start:end], alone.transpose(1, 2), atol=1e-6, rtol=0)


def test_token_budget_groups_are_balanced():
    lengths = [900, 500, 450, 300, 120, 100, 60, 40]  # 2,470 tokens under a 1,024 budget: 3 groups
    groups = packed_micro_batches(lengths, 1024)
    assert sorted(i for g in groups for i in g) == list(range(8))
    sums = sorted(sum(lengths[i] for i in g) for g in groups)
    assert len(groups) == 3 and max(sums) <= 1024 and sums[-1] - sums[0] <= 300, sums
    assert packed_micro_batches([2000, 10], 1024) == [[0], [1]]  # a row over the budget runs alone


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=24), st.integers(1, 600), st.integers(1, 30))
def test_groups_cover_every_row_once_within_budget_and_split_to_any_count(lengths, budget, count):
    groups = packed_micro_batches(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)
    split = split_to_count(groups, lengths, max(count, len(groups)))
    assert len(split) == max(count, len(groups))
    assert sorted(i for g in split for i in g) == list(range(len(lengths)))
    assert all(g or all(len(h) <= 1 for h in split) for g in split)  # empty groups only once nothing splits


def _steps_and_logprobs(rank, world, path, packed, micro, max_tokens, bucketed=False):
    from slime_hydra.train.fsdp import FSDPBackend

    train = TrainConfig(**CFG, micro_batch_samples=micro, max_tokens_per_gpu=max_tokens, pack_sequences=packed,
                        cuda_graphs=bucketed)  # on the CPU (no compile): the bucketed layout without graphs
    backend = FSDPBackend(path, train, total_steps=3)
    batch = toy_batch()
    # rank 1 gets the shorter rows: under a token budget it needs fewer micro-batches than rank 0 (packed at 12
    # tokens: 3 against 4; padded at 18: 2 against 3) and splits one, or the ranks' FSDP gathers would not pair up
    lengths = batch.attention_mask.sum(-1).tolist()
    by_length = sorted(range(8), key=lambda i: -lengths[i])
    mine = batch.select(sorted(by_length[rank::world]) if world > 1 else list(range(8)))
    steps = [backend.train_step(mine, pg_loss) for _ in range(3)]
    logp, entropy = backend.logprobs(batch, with_entropy=True)
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in steps], logp, entropy


@pytest.mark.parametrize("world,micro,max_tokens,bucketed", [(1, 3, None, False), (1, 8, 20, False),
                                                             (2, 8, 12, False), (2, 8, 18, False), (1, 3, None, True)])
def test_packed_steps_and_logprobs_equal_padded_ones(world, micro, max_tokens, bucketed):
    """bucketed: the shapes train.cuda_graphs rounds to (a filler sequence and empty ones) change nothing."""
    path = tiny_checkpoint()
    padded = run_ranks(world, _steps_and_logprobs, path, False, micro, max_tokens)[0]
    packed = run_ranks(world, _steps_and_logprobs, path, True, micro, max_tokens, bucketed)[0]
    for (loss, norm), (ref_loss, ref_norm) in zip(packed[0], padded[0]):
        assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5 * max(1, ref_norm)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[2], padded[2], atol=1e-5, rtol=0)
    assert padded[0][2][0] < padded[0][0][0]  # the loss falls: the steps train


def _megatron_steps_and_logprobs(rank, world, path, packed, micro, max_tokens, bucketed=False):
    from slime_hydra.train.megatron.backend import MegatronBackend

    train = TrainConfig(**CFG, backend="megatron", num_gpus=world, tp=world, micro_batch_samples=micro,
                        max_tokens_per_gpu=max_tokens, pack_sequences=packed, cuda_graphs=bucketed)
    backend = MegatronBackend(path, train, total_steps=3)
    batch = toy_batch()  # TP peers see the same rows
    steps = [backend.train_step(batch, pg_loss) for _ in range(3)]
    logp, entropy = backend.logprobs(batch, temperature=0.7, with_entropy=True)
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in steps], logp, entropy


@pytest.mark.parametrize("model,world,micro,max_tokens,bucketed", [
    ("dense", 1, 3, None, False), ("dense", 2, 8, 20, False), ("moe", 1, 8, 20, False), ("dense", 2, 8, 20, True),
    ("moe", 1, 8, 20, True)])
def test_megatron_packed_steps_and_logprobs_equal_padded_ones(model, world, micro, max_tokens, bucketed):
    """train=megatron on packed rows (THD, per-sequence RoPE and attention; TP2: vocab-parallel head on the kept
    positions; a MoE model's experts on the packed tokens) against its padded path. The MoE logprobs (near -8 at
    temperature 0.7) differ in fp32's last digits (2e-5): the grouped expert matmuls see other token counts."""
    path = tiny_checkpoint() if model == "dense" else moe_checkpoint("mixed")
    padded = run_ranks(world, _megatron_steps_and_logprobs, path, False, micro, max_tokens)[0]
    packed = run_ranks(world, _megatron_steps_and_logprobs, path, True, micro, max_tokens, bucketed)[0]
    for (loss, norm), (ref_loss, ref_norm) in zip(packed[0], padded[0]):
        assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5 * max(1, ref_norm)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[2], padded[2], atol=1e-5, rtol=1e-5)
    assert padded[0][2][0] < padded[0][0][0]


def _critic_values(rank, world, path, backend, packed):
    from slime_hydra.train.fsdp import FSDPBackend
    from slime_hydra.train.megatron.backend import MegatronBackend

    torch.manual_seed(0)  # the fresh value head's init
    cls = MegatronBackend if backend == "megatron" else FSDPBackend
    train = TrainConfig(**CFG, backend=backend, micro_batch_samples=3, pack_sequences=packed)
    return cls(path, train, total_steps=1, role="critic").values(toy_batch())


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_packed_critic_values_equal_padded_ones(backend):
    path = tiny_checkpoint()
    padded = run_ranks(1, _critic_values, path, backend, False)[0]
    torch.testing.assert_close(run_ranks(1, _critic_values, path, backend, True)[0], padded, atol=1e-5, rtol=0)
    assert padded.abs().sum() > 0


def _bf16_compiled(rank, world, path, packed, graphs=False):
    from slime_hydra.train.fsdp import FSDPBackend

    train = TrainConfig(lr=1e-2, dtype="bf16", clip_grad=1.0, micro_batch_samples=3, compile=True,
                        pack_sequences=packed, cuda_graphs=graphs)
    backend = FSDPBackend(path, train, total_steps=3)
    batch = toy_batch()
    steps = [backend.train_step(batch, pg_loss) for _ in range(3)]
    return [(float(m["pg_loss"]), m["grad_norm"]) for m in steps], backend.logprobs(batch)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_varlen_attention_on_gpu_matches_padded_sdpa():
    """bf16 and compiled, as on a GPU run: varlen flash attention on packed rows against SDPA on padded ones. The
    two differ by bf16 rounding only (different kernels sum in different orders). With train.cuda_graphs the rows
    are bucketed (a filler sequence, empty sequences in cu_seqlens) and replayed as graphs: the same numbers."""
    path = tiny_checkpoint()
    padded = run_ranks(1, _bf16_compiled, path, False)[0]
    packed = run_ranks(1, _bf16_compiled, path, True)[0]
    graphed = run_ranks(1, _bf16_compiled, path, True, True)[0]
    for (loss, norm), (ref_loss, ref_norm) in zip(packed[0], padded[0]):
        assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss) and abs(norm - ref_norm) <= 2e-2 * ref_norm
    gap = (packed[1] - padded[1]).abs()
    print(f"packed vs padded bf16 logprobs: max {gap.max():.2e}, mean {gap.mean():.2e}")
    assert gap.max() < 5e-2 and gap.mean() < 5e-3
    graph_gap = (graphed[1] - packed[1]).abs()
    print(f"bucketed CUDA-graph vs packed bf16 logprobs: max {graph_gap.max():.2e}, mean {graph_gap.mean():.2e}")
    assert graph_gap.max() < 5e-2 and graph_gap.mean() < 5e-3
    assert padded[0][2][0] < padded[0][0][0]
