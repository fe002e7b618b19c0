"""train=megatron's pipeline schedule (pp > 1): every micro-batch through every stage in megatron's 1F1B order.

Each stage runs its layers on every micro-batch; activations [s, b, H] (sent in fp32, cast to the compute dtype at
the receiving stage) go to the next stage and their gradients come back, point to point between the ranks of the
same TP slot, in megatron's 1F1B order (stage r runs pp - r - 1 warm-up forwards, then alternates one forward and
one backward, then drains the backwards). Megatron's own schedules (``get_forward_backward_func``) allocate their
receive buffers and token counter on CUDA (``torch.cuda.current_device()``, ``device="cuda"``), so they cannot run
on the CPU test ranks; ``Pipeline.run`` is the same schedule over torch.distributed send/recv, identical on CPU
(gloo) and GPU (nccl). The last stage turns its output into the loss (training) or logprobs/values, which it
broadcasts over the PP group with the metrics (``from_last_stage``).

With pp = 1 the schedule is a plain loop: forward (and backward) of each micro-batch in turn, nothing sent.
"""

from typing import Callable

import torch
import torch.distributed as dist

from slime_hydra.train.batch import TrainBatch
from slime_hydra.train.precision import ComputeCopy

Stage = Callable[[TrainBatch, TrainBatch, torch.Tensor | None], torch.Tensor]
"""stage(host micro-batch, the same on the device, the previous stage's hidden states or None on the first stage)
-> this stage's output: hidden states [s, b, H], or on the last stage the model's output."""


class Pipeline:
    """The 1F1B schedule over ``pp_group`` for one stage: ``stage`` runs this rank's layers, ``activation_shape``
    gives the [s, b, H] a stage receives for a (device) micro-batch, ``compute`` (if any) takes each backward's
    gradients into the fp32 masters."""

    def __init__(self, stage: Stage, activation_shape: Callable[[TrainBatch], tuple[int, int, int]],
                 pp_group: dist.ProcessGroup, device: torch.device, compute: ComputeCopy | None):
        self.stage, self.activation_shape = stage, activation_shape
        self.pp_group, self.device, self.compute = pp_group, device, compute
        self.pp_rank, self.pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1

    def run(self, mbs: list[TrainBatch], on_output: Callable, backward: bool,
            before_backward: Callable[[int], None] | None = None) -> None:
        """Every micro-batch through every stage in 1F1B order (module docstring); the last stage calls
        ``on_output(k, micro_batch, output)``, which returns the scaled loss to backpropagate when ``backward``
        (``mbs``: host batches, each moved to the device here); every stage calls ``before_backward(k)`` (if given)
        right before micro-batch k's backward, which on stages but the last comes after later forwards. Collective
        over the PP group (each rank talks to its neighbours of the same TP slot)."""
        from megatron.core import parallel_state

        n = len(mbs)
        inputs, outputs, pending = [None] * n, [None] * n, []

        def forward(k: int) -> None:
            mb, hidden = mbs[k].to(self.device), None
            if not self.first_stage:
                hidden = torch.empty(*self.activation_shape(mb), device=self.device, requires_grad=backward)
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            out = self.stage(mbs[k], mb, hidden)
            if self.last_stage:
                outputs[k] = on_output(k, mb, out)
            else:
                out = out.float()
                pending.append((dist.isend(out.detach(), dst=parallel_state.get_pipeline_model_parallel_next_rank()),
                                out))
                outputs[k] = out if backward else None
            inputs[k] = hidden if backward else None

        def backward_step(k: int) -> None:
            if before_backward is not None:
                before_backward(k)
            if self.last_stage:
                outputs[k].backward()
            else:
                grad = torch.empty_like(outputs[k])
                dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank())
                torch.autograd.backward(outputs[k], grad)
            if self.compute is not None:
                self.compute.accumulate_grads()
            if not self.first_stage:
                pending.append((dist.isend(inputs[k].grad, dst=parallel_state.get_pipeline_model_parallel_prev_rank()),
                                inputs[k]))
            inputs[k] = outputs[k] = None

        if not backward:
            for k in range(n):
                forward(k)
        else:
            warmup = min(self.pp_size - self.pp_rank - 1, n)
            for k in range(warmup):
                forward(k)
            for k in range(n - warmup):
                forward(warmup + k)
                backward_step(k)
            for k in range(n - warmup, n):
                backward_step(k)
        for work, _ in pending:  # the tensor stays referenced until its send completes
            work.wait()

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's host ``tensor`` on every stage (through the device: nccl carries CUDA tensors only)."""
        if self.pp_size == 1:
            return tensor
        on_device = tensor.to(self.device)
        dist.broadcast(on_device, src=dist.get_global_rank(self.pp_group, self.pp_size - 1), group=self.pp_group)
        return on_device.cpu()
