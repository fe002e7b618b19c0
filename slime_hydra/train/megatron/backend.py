"""train=megatron: megatron-core GPTModel with tensor parallelism (TP) inside a model replica and data
parallelism (DP) across replicas; the backend protocol of train/fsdp.py, with the same semantics.

Ranks: world = tp x dp (train.pp = train.cp = 1), TP fastest (ranks 0..tp-1 hold one replica). TP peers see the
same rows (TrainGroup deals rows by ``dp_rank``/``dp_size``) and compute the same loss.

Loss scaling (as FSDP, over DP ranks): the loss callable's micro-batch mean is scaled by
units(micro) / units(global batch, summed over DP ranks) * dp_size; gradients are summed over micro-batches and
averaged over the DP group, so the step equals one on the global-batch mean whatever the micro-batch split.

Gradients: megatron's DistributedDataParallel and DistributedOptimizer need CUDA and megatron's own training loop
state; this backend reduces gradients itself, identically on CPU (gloo) and GPU (nccl): after the last
micro-batch, the q/k-norm gradients (shared across heads, each TP rank sees only its heads) are summed over TP,
then every gradient is averaged over DP in flat buckets. The optimizer is optim.py's AdamW over this rank's
parameter shards (fp32 masters; bf16 compute under autocast on GPU) -- no ZeRO sharding of optimizer states.

Grad norm: sum of squares of the TP-split parameters all-reduced over TP, plus the replicated ones (norms) once;
clipping as torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6), capped at 1).

Logprobs: the output layer stays vocab-parallel; vocab_parallel.py turns this rank's logit slice into logprobs and
entropy with all-reduces of max, sum-exp and the target logit over TP.

Reference policy: this rank's initial parameter shards on the host, swapped in for ``policy="ref"``.

Checkpoints: per TP rank, model and optimizer shards (written by DP rank 0 of each TP slot), scheduler and step,
and every rank's RNG state; resume needs the same world size and tp. To change the layout, export_hf and start a
new run from the export (optimizer state is not carried).

Not supported (refused at construction): pipeline parallelism (pp > 1; it needs megatron's p2p schedules),
context parallelism (cp > 1; the SDPA core attention has none), MoE (ep > 1), the PPO critic (train=fsdp has it).
"""

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from slime_hydra.train.batch import TrainBatch, predicting_positions, loss_units, micro_batches
from slime_hydra.train.config import TrainConfig
from slime_hydra.train.reference import host_copy, swapped_in
from slime_hydra.train.fsdp import rng_state, set_rng_state
from slime_hydra.train.megatron.convert import iter_hf_weights, load_hf_weights, param_map
from slime_hydra.train.megatron.model import (Arch, build_model, init_parallel, transformer_config,
                                              transformer_engine_available)
from slime_hydra.train.megatron.vocab_parallel import vocab_parallel_logprobs
from slime_hydra.train.optim import build_optimizer

LossFn = Callable[[torch.Tensor, torch.Tensor | None, TrainBatch], tuple[torch.Tensor, dict[str, float]]]

BUCKET_ELEMENTS = 64 * 1024 * 1024
"""Gradient elements per DP all-reduce (256 MiB of fp32)."""


class MegatronBackend:
    def __init__(self, model_path: str | Path, train: TrainConfig, total_steps: int, loss_agg: str = "token_mean",
                 keep_reference: bool = False, device: str | None = None, role: str = "actor"):
        from megatron.core import parallel_state

        if not dist.is_initialized():
            raise RuntimeError("MegatronBackend needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        if role != "actor":
            raise ValueError("train=megatron trains the policy only; PPO's critic needs train=fsdp")
        unsupported = [f"train.{k}={getattr(train, k)}" for k in ("pp", "cp", "ep") if getattr(train, k) != 1]
        if unsupported:
            raise ValueError(f"train=megatron supports tensor and data parallelism only; set {', '.join(unsupported)}"
                             " to 1 (pipeline/context/expert parallelism are not implemented)")
        if train.gradient_checkpointing and not torch.cuda.is_available():
            raise ValueError("megatron's activation recompute saves CUDA RNG states: on CPU set "
                             "train.gradient_checkpointing=false")
        world = dist.get_world_size()
        if world % train.tp:
            raise ValueError(f"{world} ranks are not a multiple of train.tp={train.tp}")
        self.train_cfg, self.loss_agg = train, loss_agg
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        init_parallel(train.tp)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.tp_rank, self.tp_size = dist.get_rank(self.tp_group), train.tp
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)

        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.arch = Arch.from_hf(self.hf_config)
        use_te = transformer_engine_available() and self.device.type == "cuda"
        overrides = dict(train.megatron)
        if train.gradient_checkpointing:
            overrides = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
                         **overrides}
        config = transformer_config(self.arch, tp=train.tp, device=self.device.type, use_te=use_te,
                                    overrides=overrides)
        self.model = build_model(self.arch, config, use_te, self.device)
        load_hf_weights(self.model, model_path, self.arch)
        self._tp_split = {p.megatron for p in param_map(self.arch, use_te) if p.kind != "replicated"}
        self._tp_partial = {n for n, _ in self.model.named_parameters()
                            if n.endswith(("q_layernorm.weight", "k_layernorm.weight"))}
        self.vocab_start = self.tp_rank * (self.arch.vocab_size // self.tp_size)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if train.dtype == "bf16" and self.device.type == "cuda" else nullcontext())
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), train, total_steps, train.lr)
        self.step = 0
        self._ref_shards = host_copy(self._local_shards()) if keep_reference else None

    # ---- forward ----------------------------------------------------------------------------------------------
    def _forward(self, mb: TrainBatch, temperature: float, with_entropy: bool):
        """(logp, entropy) [B, T] of the response tokens, identical on every TP rank."""
        ids = mb.input_ids
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device).unsqueeze(0).expand_as(ids)
        with self.autocast:  # right padding + causal attention: real tokens never see the padding
            logits = self.model(ids, positions, None)  # [B, L, V / tp]
        pos, valid = predicting_positions(mb, length)
        b, t = mb.loss_mask.shape
        picked = torch.gather(logits, 1, pos.unsqueeze(-1).expand(b, t, logits.shape[-1])).float()
        if temperature != 1.0:
            picked = picked / temperature
        targets = torch.gather(ids, 1, (pos + 1).clamp(max=length - 1))
        logp, entropy = vocab_parallel_logprobs(picked, targets, self.vocab_start, self.tp_group, with_entropy)
        return logp * valid, (entropy * valid if with_entropy else None)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, policy: str = "current", temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] logprobs (and entropy) of the response tokens under the current or the reference policy."""
        if policy == "ref" and self._ref_shards is None:
            raise ValueError("no reference policy kept: construct with keep_reference=True")
        with swapped_in(self._local_shards(), self._ref_shards) if policy == "ref" else nullcontext():
            self.model.eval()
            logp = torch.zeros(batch.loss_mask.shape)
            ent = torch.zeros(batch.loss_mask.shape) if with_entropy else None
            for idx in micro_batches(batch, self.train_cfg.micro_batch_samples, self.train_cfg.max_tokens_per_gpu):
                lp, en = self._forward(batch.select(idx).to(self.device), temperature, with_entropy)
                logp[idx, : lp.shape[1]] = lp.float().cpu()
                if with_entropy:
                    ent[idx, : en.shape[1]] = en.float().cpu()
        return logp, ent

    # ---- training ---------------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; returns averaged metrics + grad_norm, lr."""
        self.model.train()
        groups = micro_batches(batch, self.train_cfg.micro_batch_samples, self.train_cfg.max_tokens_per_gpu)
        total_units = loss_units(batch.loss_mask, self.loss_agg).to(self.device, torch.float64)
        dist.all_reduce(total_units, group=self.dp_group)
        sums: dict[str, float] = {}
        for idx in groups:
            mb = batch.select(idx).to(self.device)
            logp, entropy = self._forward(mb, temperature, with_entropy)
            loss, metrics = loss_fn(logp, entropy, mb)
            weight = float(loss_units(mb.loss_mask, self.loss_agg)) / float(total_units)
            (loss * weight * self.dp_size).backward()
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value) * weight
        self._reduce_gradients()
        grad_norm = self._clip_gradients(self.train_cfg.clip_grad)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        reduced = torch.tensor(list(sums.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced, group=self.dp_group)  # each DP rank's weighted sum covers its units
        out = dict(zip(sums, reduced.tolist()))
        out.update(grad_norm=grad_norm, lr=lr)
        return out

    def _reduce_gradients(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every rank must bring every gradient to the collectives
                p.grad = torch.zeros_like(p)
        if self.tp_size > 1:
            for name, p in self.model.named_parameters():
                if name in self._tp_partial:
                    dist.all_reduce(p.grad, group=self.tp_group)
        if self.dp_size > 1:
            bucket, elements = [], 0
            for k, p in enumerate(params):
                bucket.append(p.grad)
                elements += p.grad.numel()
                if elements >= BUCKET_ELEMENTS or k == len(params) - 1:
                    flat = torch.cat([g.reshape(-1) for g in bucket])
                    dist.all_reduce(flat, group=self.dp_group)
                    flat /= self.dp_size
                    for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                        g.copy_(part.view_as(g))
                    bucket, elements = [], 0

    def _clip_gradients(self, max_norm: float) -> float:
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.model.named_parameters():
            square = p.grad.detach().double().pow(2).sum()
            if name in self._tp_split:
                split += square
            else:
                replicated += square
        if self.tp_size > 1:
            dist.all_reduce(split, group=self.tp_group)
        norm = float((split + replicated).sqrt())
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in self.model.parameters()], coef)
        return norm

    # ---- weights ----------------------------------------------------------------------------------------------
    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every HF state-dict entry, gathered over TP one at a time. Collective: all
        ranks of this TP group (every DP replica yields the same tensors)."""
        yield from iter_hf_weights(self.model, self.arch, self.tp_group)

    def export_hf(self, out_dir: str | Path) -> None:
        """Write an HF checkpoint (config + safetensors) of the current weights; rank 0 writes. Collective."""
        if self.dp_rank == 0:  # the first replica's TP group gathers; the others hold the same weights
            state = {name: tensor.cpu() for name, tensor in self.iter_full_weights()}
            if dist.get_rank() == 0:
                net = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
                net.load_state_dict(state, strict=True)
                if self.hf_config.tie_word_embeddings:
                    net.tie_weights()
                net.save_pretrained(out_dir, safe_serialization=True)
        dist.barrier()

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def save(self, ckpt_dir: str | Path) -> None:
        """Resumable checkpoint: this TP slot's parameters, optimizer and reference shards; scheduler, step; RNG."""
        from megatron.core import tensor_parallel

        ckpt_dir = Path(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        if self.dp_rank == 0:
            torch.save({"model": host_copy(self._local_shards()), "optim": self.optimizer.state_dict(),
                        "ref": self._ref_shards}, ckpt_dir / f"tp{self.tp_rank}.pt")
        torch.save({"rng": rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()},
                   ckpt_dir / f"rank{rank}.pt")
        if rank == 0:
            (ckpt_dir / "trainer.json").write_text(json.dumps(
                {"step": self.step, "scheduler": self.scheduler.state_dict(), "world": dist.get_world_size(),
                 "tp": self.tp_size}))
        dist.barrier()

    def load(self, ckpt_dir: str | Path) -> None:
        from megatron.core import tensor_parallel

        ckpt_dir = Path(ckpt_dir)
        meta = json.loads((ckpt_dir / "trainer.json").read_text())
        if (meta["world"], meta["tp"]) != (dist.get_world_size(), self.tp_size):
            raise ValueError(f"checkpoint {ckpt_dir} was saved by {meta['world']} ranks at tp={meta['tp']}; this run "
                             f"has {dist.get_world_size()} ranks at tp={self.tp_size}")
        shards = torch.load(ckpt_dir / f"tp{self.tp_rank}.pt", map_location="cpu", weights_only=False)
        live = self._local_shards()
        with torch.no_grad():
            for name, saved in shards["model"].items():
                live[name].copy_(saved)
        self.optimizer.load_state_dict(shards["optim"])
        self._ref_shards = shards["ref"]
        self.scheduler.load_state_dict(meta["scheduler"])
        self.step = meta["step"]
        local = torch.load(ckpt_dir / f"rank{dist.get_rank()}.pt", weights_only=False)
        set_rng_state(local["rng"])
        tensor_parallel.get_cuda_rng_tracker().set_states(local["tracker"])

    # ---- reference swap ---------------------------------------------------------------------------------------
    def _local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter, by name."""
        return dict(self.model.named_parameters())
