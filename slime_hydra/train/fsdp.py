"""train=fsdp: torch-native FSDP2 (fully_shard) over the HF transformers model, data parallel across ranks.

Every rank runs the same calls (they are collective). The process group is initialised by the caller (the Ray
rank actor, or a test harness): gloo on CPU, nccl on GPU. Parameters are fp32 masters; on GPU with dtype=bf16 the
forward/backward run in bf16 with fp32 gradient reduction: over several ranks FSDP2's MixedPrecisionPolicy; on
one rank (nothing to shard) the model is not wrapped and ``ComputeCopy`` does the same with one multi-tensor copy
each way, because FSDP's per-layer hooks cost as much host time as the layers themselves (docs/benchmarks.md).

Speed (a 0.5B model's step is ~1,600 short kernels): with ``train.compile`` each decoder layer's forward and the
logprob head are torch.compiled (fused norm / rotary / SwiGLU kernels); the layer is compiled before fully_shard
wraps it, so FSDP's hooks stay eager around the compiled graphs; ``train.cuda_graphs`` replays the compiled layers
as CUDA graphs. The LM head runs only from the first position that predicts a response token (``logits_to_keep``).

Padding-free micro-batches (``train.pack_sequences``, train/packing.py): each micro-batch's sequences run as one
row with variable-length attention, and the LM head only at the positions that predict response tokens; a token
budget (``train.max_tokens_per_gpu``) then counts real tokens and balances them over the micro-batches. Under a
token budget with several ranks, every rank runs as many micro-batches as the rank with the most (batch.
split_to_count): FSDP's parameter gathers are collective per forward.

Loss scaling (exact gradient accumulation and DP): the loss callable returns the mean loss of a micro-batch over
its units (tokens for token_mean, sequences otherwise); the backend scales it by
units(micro) / units(global batch, all ranks) * world_size, so after FSDP's gradient averaging over ranks the
gradient equals that of the global-batch mean, whatever the micro-batch split.

Critic (PPO): ``role="critic"`` loads the same checkpoint as a token-classification model with one output (a fresh
value head), trains with ``train.critic_lr``, and its forward yields values in place of logprobs. Teacher
(on-policy distillation): ``role="teacher"`` loads its checkpoint frozen, in the compute dtype, with no optimizer.

Colocated with engines on GPUs, ``offload`` moves parameters and optimizer state to the host while the engines
generate and ``onload`` brings them back (train/offload.Offloadable).

Routing replay (MoE actors, train/routing_replay.py): a batch with ``routed_experts`` is routed as the engine routed
it, in every forward (old, reference and training logprobs); a batch without them is routed by the model.

Reference policy: the initial weights' local shards are kept on the host; ``logprobs(..., policy="ref")`` copies
them into the parameters, runs the forward, and copies the trained shards back (slime's swap; no second GPU copy).

LoRA (train.lora, train/lora.py): the actor is PEFT's model around the HF one (``get_peft_model``). The base weights
load in the compute dtype and stay frozen: no fp32 master, no gradient, no optimizer state (no ComputeCopy either:
PEFT keeps the adapters in fp32 and runs them in fp32 on the upcast input, adding into the base layer's output).
Over several ranks FSDP2 casts every parameter to the compute dtype (its all-gather takes one dtype), so there the
adapters compute in bf16. The reference policy is the same model inside PEFT's ``disable_adapter``; checkpoints hold
only the trainable tensors (``ignore_frozen_params``); weight sync and export merge W + scale * B A. PPO's critic
trains fully.
"""

import copy
import functools
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from slime_hydra.durable import write_json
from slime_hydra.model import invariant
from slime_hydra.train.batch import (BatchLogprobs, TrainBatch, first_predicting_position, loss_units,
                                     micro_batches, response_logprobs, response_values, split_to_count)
from slime_hydra.train.packing import ATTENTION, pack, packed_logprobs, packed_values, register_attention
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.backend import (
    LossFn, StepMetrics, TrainBackend, allow_recompiles, compile_options, export_dtype, is_frozen, load_rank_file,
    rng_state, set_rng_state, write_rank_file,
)
from slime_hydra.train.precision import ComputeCopy, compute_dtype
from slime_hydra.train.reference import host_copy, pinned, swapped_in
from slime_hydra.train.routing_replay import RoutingReplay, moe_routers
from slime_hydra.train.optim import build_optimizer, clip_and_step, continue_schedule
from slime_hydra.train.lora import merged_weights, peft_adapter_weights, peft_config, seeded_init


class FSDPBackend(TrainBackend):
    def __init__(self, model_path: str | Path, train: TrainConfig, total_steps: int, loss_agg: str = "token_mean",
                 keep_reference: bool = False, device: str | None = None, role: str = "actor",
                 fsdp: bool | None = None, batch_invariant: bool = False):
        """``fsdp``: wrap the model with FSDP2; None wraps it when there is more than one rank. ``batch_invariant``
        (algo.true_on_policy): the engine's batch-invariant forward and logprobs (model/invariant.py), never
        compiled."""
        if not dist.is_initialized():
            raise RuntimeError("FSDPBackend needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        self.train_cfg, self.loss_agg = train, loss_agg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.world = dist.get_world_size()
        self.dp_rank, self.dp_size = dist.get_rank(), self.world  # FSDP: every rank is a data-parallel rank
        self.role, frozen = role, is_frozen(role)
        low = compute_dtype(train, self.device)
        self.lora = train.lora.enabled and role == "actor"
        self.packed = train.pack_sequences
        if batch_invariant:
            attention = invariant.register_attention()
        elif self.packed:
            attention = register_attention()
        else:
            attention = "sdpa"
        if role == "critic":  # PPO's value model: the same trunk with a fresh 1-output head ("score")
            config = AutoConfig.from_pretrained(model_path, num_labels=1, classifier_dropout=0.0)  # deterministic
            model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, dtype=torch.float32,
                                                                    attn_implementation=attention)
        else:
            dtype = low if self.lora or frozen else torch.float32
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attention)
        if frozen:
            model.requires_grad_(False)
        if batch_invariant:
            invariant.make_batch_invariant(model)
        if train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf = model
        if self.lora:  # A, B in fp32 (autocast_adapter_dtype); everything else frozen
            from peft import get_peft_model  # only LoRA runs pay for importing peft (lora.peft_config)

            with seeded_init():
                model = get_peft_model(model, peft_config(train.lora), autocast_adapter_dtype=True)
        model.to(self.device)
        # MoE actors: every forward can replay the engine's routing (batch.routed_experts, algo.routing_replay)
        self.replay = RoutingReplay(hf.model.layers) if role == "actor" and moe_routers(hf.model.layers) else None
        self.compiled = not batch_invariant and train.compiles(self.device.type)
        head = packed_logprobs if self.packed else response_logprobs
        head = functools.partial(head, invariant=True) if batch_invariant else head
        if batch_invariant:  # and the engine's kernels under deterministic=true (model/invariant.engine_kernels)
            self._forward = invariant.engine_kernels()(self._forward)
        self._head = torch.compile(head) if self.compiled else head
        if self.compiled:  # the forward only: FSDP's hooks (dynamo-disabled) run eagerly around it
            allow_recompiles(16)
            for layer in hf.model.layers:
                layer.forward = torch.compile(layer.forward, fullgraph=True, options=compile_options(train))
        self.fsdp = self.world > 1 if fsdp is None else fsdp
        if self.world > 1 and not self.fsdp:
            raise ValueError(f"fsdp=False runs one rank only (no gradient averaging), got {self.world} ranks")
        self._compute = None
        if self.fsdp:
            mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            for layer in hf.model.layers:  # one rank (fsdp=True in tests): keep layers unsharded for the backward
                fully_shard(layer, mp_policy=mp, reshard_after_forward=self.world > 1)
            fully_shard(model, mp_policy=mp)
        elif low != torch.float32 and not self.lora and not frozen:
            self._compute = ComputeCopy(model, low)
        self.model, self.hf = model, hf
        self._trainable = frozenset(n for n, p in model.named_parameters() if p.requires_grad)
        """Names of the parameters that train (all of them without LoRA)."""
        peak = train.critic_lr if role == "critic" else train.lr
        self.optimizer, self.scheduler = (None, None) if frozen else build_optimizer(model.parameters(), train,
                                                                                     total_steps, peak)
        self.step = 0
        self.keep_reference = keep_reference
        self._ref_shards = host_copy(self._local_shards()) if keep_reference and not self.lora else None
        # a gloo group of its own for DCP's background thread (made at the first background save): its collectives
        # then never interleave with the training's on the default group
        self._save_group = None

    # ---- forward ----------------------------------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        """Row groups of this rank's batch (module docstring); [] marks a group run with zero weight."""
        budget = self.train_cfg.max_tokens_per_gpu
        groups = micro_batches(batch, self.train_cfg.micro_batch_samples, budget, packed=self.packed)
        if budget is not None and self.world > 1:  # only a token budget makes the ranks' counts differ
            count = torch.tensor([len(groups)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            groups = split_to_count(groups, batch.attention_mask.sum(-1).tolist(), int(count))
        return groups

    def _forward(self, host: TrainBatch, mb: TrainBatch, temperature: float, with_entropy: bool):
        """Actor: (logp, entropy) of the response tokens. Critic: (values, None). All [B, T].

        ``host``: the micro-batch on the host, ``mb`` the same on the device; layouts come from the host copy (no
        device sync)."""
        if self.packed:
            packed = pack(host, bucketed=self.train_cfg.cuda_graphs)
            return self._forward_packed(packed.to(self.device), temperature, with_entropy)
        first = first_predicting_position(host)
        if self.role == "critic":
            out = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            return response_values(out, mb), None
        keep = mb.input_ids.shape[1] - first
        with self.replay.replaying(mb.routed_experts) if self.replay is not None else nullcontext():
            out = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                             logits_to_keep=keep).logits
        return self._head(out, mb, temperature, with_entropy, first)

    def _forward_packed(self, packed, temperature: float, with_entropy: bool):
        """_forward on a packed micro-batch (packing.PackedBatch): the logits of the kept positions only."""
        if self.role == "critic":
            return packed_values(self.model(**packed.model_kwargs(), use_cache=False).logits, packed), None
        with self.replay.replaying(packed.routed_experts) if self.replay is not None else nullcontext():
            out = self.model(**packed.model_kwargs(), use_cache=False, logits_to_keep=packed.keep).logits
        return self._head(out, packed, temperature, with_entropy)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, policy: str = "current", temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] logprobs (and entropy) of the response tokens under the current or the reference policy.

        For the critic this returns the values V(s_j) instead (see ``values``)."""
        if policy == "ref" and not self.keep_reference:
            raise ValueError("no reference policy kept: construct with keep_reference=True")
        with self._policy(policy), self._computing():
            self.model.eval()
            filled = BatchLogprobs(batch, self.device, with_entropy)
            for idx in self._micro_batches(batch):
                host = batch.select(idx or [0])
                out = self._forward(host, host.to(self.device), temperature, with_entropy)
                if idx:
                    filled.put(idx, *out)
            if self.fsdp:
                self.model.reshard()  # FSDP2 keeps the root's parameters unsharded after a forward without backward
        return filled.host()

    def _policy(self, policy: str):
        """The block runs the current policy, or the reference: the base model under LoRA, else the initial
        weights swapped in."""
        if policy != "ref":
            return nullcontext()
        return self.model.disable_adapter() if self.lora else swapped_in(self._local_shards(), self._ref_shards)

    # ---- training ---------------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; returns averaged metrics + grad_norm, lr."""
        self.model.train()
        groups = self._micro_batches(batch)
        total_units = loss_units(batch.loss_mask, self.loss_agg).to(torch.float64)
        dist.all_reduce(total_units)
        step_metrics = StepMetrics()
        with self._computing():
            for k, idx in enumerate(groups):
                host = batch.select(idx or [0])  # weights and positions from host tensors: no device sync in the loop
                weight = float(loss_units(host.loss_mask, self.loss_agg)) / float(total_units) if idx else 0.0
                mb = host.to(self.device)
                if self.fsdp:
                    self.model.set_requires_gradient_sync(k == len(groups) - 1)
                logp, entropy = self._forward(host, mb, temperature, with_entropy)
                loss, metrics = loss_fn(logp, entropy, mb)
                (loss * weight * self.world).backward()
                if self._compute is not None:
                    self._compute.accumulate_grads()
                if idx:
                    step_metrics.add(metrics, weight)
        self._optimizer_state_ready(to_write=True)  # colocated: copies may be in flight (train/offload.py)
        lr = self.scheduler.get_last_lr()[0]
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if self.fsdp:  # DTensor gradients: torch's clipping, whose norm and coefficient stay DTensors
            max_norm = self.train_cfg.clip_grad if self.train_cfg.clip_grad > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(trained, max_norm).full_tensor()
            self.optimizer.step()
        else:
            grads = [p.grad for p in trained if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
            clip_and_step(self.optimizer, grads, grad_norm, self.train_cfg.clip_grad)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        out = StepMetrics.reduce(step_metrics.values(), None, torch.device("cpu"))  # over all ranks (host, gloo)
        out.update(grad_norm=float(grad_norm), lr=lr)
        return out

    # ---- weights ----------------------------------------------------------------------------------------------
    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every parameter and buffer, gathered one at a time (LoRA: merged,
        lora.merged_weights). Collective: all ranks."""
        gathered = self._gathered()
        yield from merged_weights(gathered, self.train_cfg.lora.scale) if self.lora else gathered

    def iter_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.lora:
            return super().iter_adapter_weights()
        return peft_adapter_weights(self._gathered(only_trainable=True))

    def _gathered(self, only_trainable: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(state-dict name, full tensor), gathered one at a time. Collective."""
        for name, tensor in self.model.state_dict().items():
            if only_trainable and name not in self._trainable:
                continue
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            yield name, full.detach()

    def export_hf(self, out_dir: str | Path) -> None:
        """Write an HF checkpoint (config + safetensors, in ``export_dtype``) of the current weights; rank 0 writes.
        Collective."""
        if self.lora:
            state = {name: t.to("cpu") for name, t in self.iter_full_weights()}
        else:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            config = self.hf.config
            auto = AutoModelForTokenClassification if self.role == "critic" else AutoModelForCausalLM
            net = auto.from_config(config, dtype=torch.float32)
            net.load_state_dict(state, strict=False)
            if config.tie_word_embeddings:
                net.tie_weights()
            net.to(export_dtype(config)).save_pretrained(out_dir, safe_serialization=True)
        dist.barrier()

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def save(self, ckpt_dir: str | Path, background: bool = False) -> None:
        """Resumable checkpoint: sharded model + optimizer (torch.distributed.checkpoint, ``dcp/``), this rank's RNG
        and reference shards (``rank<r>.pt``), scheduler and step (``trainer.json``). Collective.

        ``background``: DCP's ``async_save`` stages the shards into host memory (the writer is its stager) and writes
        them from its own thread; a CheckpointWriter thread then writes the other two files, whose contents are
        taken now (the RNG state is a fresh copy, the reference shards never change, the scheduler is copied)."""
        self.writer.finished(wait=True)  # the stager's buffers still feed a running write until it ends
        self._optimizer_state_ready()
        ckpt_dir = Path(ckpt_dir)
        model_sd, optim_sd = self._state_dicts()
        state, rank = {"model": model_sd, "optim": optim_sd}, dist.get_rank()
        local = {"rng": rng_state(), "ref": self._ref_shards}
        meta = copy.deepcopy({"step": self.step, "scheduler": self.scheduler.state_dict(), "world": self.world})

        def write_rest() -> None:
            write_rank_file(local, ckpt_dir / f"rank{rank}.pt")
            if rank == 0:
                write_json(ckpt_dir / "trainer.json", meta)

        if not background:
            dcp.save(state, checkpoint_id=str(ckpt_dir / "dcp"))
            write_rest()
            dist.barrier()
            return
        if self._save_group is None:  # collective: every rank is in save
            self._save_group = dist.new_group(backend="gloo")
        upload = dcp.async_save(state, checkpoint_id=str(ckpt_dir / "dcp"), process_group=self._save_group,
                                async_stager=self.writer)
        self.writer.start(ckpt_dir, upload.result, write_rest)

    def load(self, ckpt_dir: str | Path, weights_only: bool = False) -> None:
        ckpt_dir = Path(ckpt_dir)
        if weights_only:  # DCP reshards: any number of ranks reads the model's entries alone
            model_sd = self._state_dicts()[0]
            dcp.load({"model": model_sd}, checkpoint_id=str(ckpt_dir / "dcp"))
            set_model_state_dict(self.model, model_sd, options=self._state_options())
            return
        meta = json.loads((ckpt_dir / "trainer.json").read_text())
        if meta["world"] != self.world:
            raise ValueError(f"checkpoint {ckpt_dir} was saved by {meta['world']} ranks, this run has {self.world}")
        model_sd, optim_sd = self._state_dicts()
        state = {"model": model_sd, "optim": optim_sd}
        # Not weights_only, and not ours to change: torch.distributed.checkpoint's reader unpickles its .metadata
        # file and loads non-tensor entries (the optimizer's param_groups) with weights_only=False (torch 2.13), so
        # the dcp/ folder must be trusted like code. The per-rank file below is loaded weights_only.
        dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self._state_options())
        continue_schedule(self.scheduler, meta["scheduler"])
        self.step = meta["step"]
        local = load_rank_file(ckpt_dir / f"rank{dist.get_rank()}.pt")
        set_rng_state(local["rng"])
        self._ref_shards = pinned(local["ref"])

    def _state_dicts(self) -> tuple[dict, dict]:
        """Model and optimizer state dicts of what a checkpoint holds: every tensor, or under LoRA only the
        trainable ones (the frozen base reloads from the model path; DCP's ``ignore_frozen_params`` alone keeps a
        tied LM head)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        if self.lora:
            model_sd = {name: t for name, t in model_sd.items() if name in self._trainable}
        return model_sd, optim_sd

    def _state_options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.lora, strict=not self.lora)

    # ---- reference swap ---------------------------------------------------------------------------------------
    def _local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by name."""
        return {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in self.model.named_parameters()}
