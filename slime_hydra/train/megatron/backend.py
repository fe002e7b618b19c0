"""train=megatron: megatron-core GPTModel with tensor (TP), context (CP), pipeline (PP) and expert (EP, MoE models)
parallelism inside a model replica and data parallelism (DP) across replicas; the backend protocol (train/backend.py),
with the same semantics, for the policy (role="actor") and PPO's critic (role="critic").

Mechanisms in their own modules: the pipeline schedule (pp > 1) in pipeline.py, gradient reduction and the grad norm in
gradients.py (clipping in the optimizer step, optim.clip_and_step), checkpoint files in checkpoint.py.

Ranks: world = tp x cp x pp x dp in megatron's order ("tp-cp-ep-dp-pp"): TP fastest, then CP, then DP, PP slowest (stage
s holds ranks [s * tp * cp * dp, (s + 1) * tp * cp * dp)). TP, CP and PP peers see the same rows (TrainGroup deals rows
by ``dp_rank``/``dp_size``) and report the same loss, logprobs and grad norm.

Context parallelism (cp > 1; context_parallel.py): each micro-batch's sequences are right-padded to a multiple of 2 * cp
and CP rank r runs chunks r and 2 * cp - 1 - r of them (megatron's load-balanced layout; RoPE rotates by the global
positions through megatron's own slicing). Attention all-gathers K and V over CP (not ring attention: every rank holds
the whole sequence's K/V, one layer at a time). The last stage gathers the per-position logprobs, entropy or values over
CP, so every CP rank computes the same loss on the full [B, T]; a token budget (``train.max_tokens_per_gpu``) counts per
GPU, so micro-batches pack cp times as many tokens.

Loss scaling (as FSDP, over DP ranks): the loss callable's micro-batch mean is scaled by units(micro) / units(global
batch, summed over DP ranks) * dp_size; gradients are summed over micro-batches and averaged over the DP group, so the
step equals one on the global-batch mean whatever the micro-batch split. CP ranks compute the same loss, but each one's
backward covers only its own chunks' share of the gradient.

Optimizer: megatron's DistributedOptimizer needs CUDA and megatron's own training loop state; this backend uses
optim.py's AdamW over this rank's parameter shards (fp32 masters; bf16 compute on GPU: see Precision below); with
``train.distributed_optimizer`` (default) and more than one data-parallel-with-CP peer, its state is sharded over those
peers (ZeRO-1, torch's ZeroRedundancyOptimizer: each parameter's Adam state lives on one peer, which updates it and
broadcasts it), megatron's distributed optimizer in effect, on CPU and GPU alike. With ep > 1 a rank's experts are a
second part (optim.Partitioned), sharded over the expert-data-parallel peers (the ranks holding the same experts), as
megatron's distributed optimizer shards expert parameters over its expert-DP group.

Logprobs: the output layer stays vocab-parallel; vocab_parallel.py turns this rank's logit slice into logprobs and
entropy with all-reduces of max, sum-exp and the target logit over TP.

Critic (role="critic"): the same trunk with ``spec.ValueHead`` as the output layer (HF's *ForTokenClassification
``score``, loaded from the checkpoint when present, else fresh), trained with ``train.critic_lr``; ``values`` and
``logprobs`` return V(s_j) aligned like logprobs (column j: the state before response token j). Teacher (algo=opd's,
role="teacher"): converted the same way over the same layout, frozen in the compute dtype, no optimizer.

Reference policy: this rank's initial parameter shards on the host, swapped in for ``policy="ref"``.

Precision and speed (a 0.5B model's step is ~1,200 short kernels): parameters are fp32 masters (the optimizer, gradient
reduction, checkpoints, weight sync and the reference swap see only those); with bf16 on GPU the forward/backward run on
``precision.ComputeCopy``'s bf16 copies of this rank's shards (one multi-tensor copy in, each backward's bf16 gradients
added into the masters' fp32 ``.grad``), not under torch.autocast (a cast per weight use). With ``train.compile`` (null:
on with CUDA) each TransformerLayer's forward and, at tp=1 cp=1, the logprob head (logsumexp of the kept positions,
batch.response_logprobs) are torch.compiled. The LM head runs only from the first position that predicts a response
token, batch-major so its logits need no transposed copy (cp=1). No device sync inside the micro-batch loop (loss
weights from host tensors; the clip coefficient stays on the device; metrics are read once, after the optimizer step).
Each layer compiles to one graph (spec.RowParallelLinear), which ``train.cuda_graphs`` replays as CUDA graphs (forward
and backward).

LoRA (train.lora.rank > 0; lora.py): PEFT's adapters on megatron's fused, TP-split linears, one A and B per targeted HF
module (q/k/v inside linear_qkv, gate/up inside linear_fc1, o_proj, down_proj), each module's s * B (A x) landing in its
rows of the fused output (s = alpha / rank). The base is frozen (requires_grad off; with bf16 compute kept in bf16
without an fp32 master; no optimizer state; the TransformerEngine spec is not used, its fused norm-linear hides the
adapters' input); ComputeCopy, the optimizer, gradient reduction and the grad norm see only the adapters (and the biases
train.lora.bias names). The reference policy is the base model: the adapters switched off (and trained biases swapped
back). ``iter_full_weights``/``export_hf`` give merged weights W + s * B A; ``iter_adapter_weights``/``export_adapter``
the full A and B under PEFT's keys; ``load_adapter`` reads a PEFT directory; checkpoints hold the adapters and their
optimizer state (the base reloads from the model path). With pp > 1 each stage holds its layers' adapters
(``iter_adapter_weights`` sends them to every stage). Refused with LoRA: dropout with tp > 1, sequence parallelism and
the rest of train/config.megatron_lora_problems (config validation refuses them first). PPO's critic trains fully.

Mixture of experts (Qwen3-MoE, GLM-4.5, DeepSeek-V3): megatron's MoELayer in the sparse layers, experts TP-split like
dense MLPs, expert parallelism (train.ep > 1) and the load-balancing loss: moe.py, whose docstring says how this backend
lays them out. DeepSeek-V3's multi-latent attention: mla.py (LoRA on it is refused). algo.true_on_policy (one rank per
replica, dense): invariant.py.

Routing replay (algo.routing_replay): a batch with ``routed_experts`` routes every MoE layer's tokens to the experts the
engine chose (moe.ReplayedChoice), in every forward; PPO's critic routes itself.

Padding-free micro-batches (``train.pack_sequences``): packed.py.

Not supported: LoRA on routed experts (on a MoE model's attention it works); ring attention or packed sequences under
CP.
"""

import functools
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from slime_hydra.model.invariant import engine_kernels
from slime_hydra.routed_experts import NO_EXPERT
from slime_hydra.train.batch import (BatchLogprobs, TrainBatch, first_predicting_position, loss_units,
                                     micro_batches, predicting_positions, response_logprobs, response_values)
from slime_hydra.train.megatron.packed import packed_head, thd_params
from slime_hydra.train.packing import PackedBatch, pack, packed_logprobs
from slime_hydra.train.config import (TrainConfig, megatron_lora_problems, megatron_moe_problems,
                                      megatron_packing_problem)
from slime_hydra.train.reference import host_copy, swapped_in
from slime_hydra.train.megatron import checkpoint
from slime_hydra.train.megatron.context_parallel import gather_sequence, local_positions, padded_length, split_sequence
from slime_hydra.train.megatron.convert import (TIED_COPY, iter_hf_weights, load_hf_weights, stage_parameters,
                                                stage_table, transformers_names)
from slime_hydra.train.megatron.gradients import Gradients
from slime_hydra.train.megatron.invariant import make_invariant, refuse_uncovered
from slime_hydra.train.megatron.lora import MegatronLora, trainable_bias
from slime_hydra.train.megatron.model import (Arch, build_model, init_parallel, transformer_config,
                                              transformer_engine_available)
from slime_hydra.train.megatron.moe import MoE
from slime_hydra.train.megatron.pipeline import Pipeline
from slime_hydra.train.megatron.vocab_parallel import vocab_parallel_logprobs
from slime_hydra.train.backend import (LossFn, StepMetrics, TrainBackend, allow_recompiles,
                                      compile_options, export_dtype, is_frozen)
from slime_hydra.train.precision import ComputeCopy, compute_dtype
from slime_hydra.train.optim import build_optimizer, clip_and_step, is_sharded


class MegatronBackend(TrainBackend):
    def __init__(self, model_path: str | Path, train: TrainConfig, total_steps: int, loss_agg: str = "token_mean",
                 keep_reference: bool = False, device: str | None = None, role: str = "actor",
                 batch_invariant: bool = False):
        """batch_invariant: the forward of algo.true_on_policy (train/megatron/invariant.py)."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            raise RuntimeError("MegatronBackend needs torch.distributed initialised (gloo on CPU, nccl on GPU)")
        frozen = is_frozen(role)
        if train.gradient_checkpointing and not torch.cuda.is_available():
            raise ValueError("megatron's activation recompute saves CUDA RNG states: on CPU set "
                             "train.gradient_checkpointing=false")
        world = dist.get_world_size()
        if world % (train.tp * train.cp * train.pp):
            raise ValueError(f"{world} ranks are not a multiple of train.tp={train.tp} x train.cp={train.cp} x "
                             f"train.pp={train.pp}")
        self.train_cfg, self.loss_agg, self.role = train, loss_agg, role
        self.head = "value" if role == "critic" else "lm"
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_path = str(model_path)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.arch = Arch.from_hf(self.hf_config,
                                 moe_aux_loss_coeff=float(train.megatron.get("moe_aux_loss_coeff", 0.0)))
        lora = train.lora.enabled and role == "actor"  # PPO's critic trains fully
        refused = megatron_moe_problems(replace(train, num_gpus=world), self.arch.num_experts)
        if refused:
            raise ValueError("train=megatron: " + "; ".join(map(str, refused)))
        if lora:
            refused = megatron_lora_problems(train.lora, train.tp, self.arch.num_kv_heads,
                                             self.arch.fused_gate_up, self.arch.qkv_bias, train.megatron)
            if refused:
                raise ValueError("train=megatron with train.lora: " + "; ".join(map(str, refused)))
        if batch_invariant:
            refuse_uncovered(train, self.arch)
        init_parallel(train.tp, train.pp, train.cp, train.ep)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.cp_group = parallel_state.get_context_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.tp_rank, self.tp_size = dist.get_rank(self.tp_group), train.tp
        self.cp_rank, self.cp_size = dist.get_rank(self.cp_group), train.cp
        self.dp_rank, self.dp_size = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        self.pp_rank, self.pp_size = dist.get_rank(self.pp_group), train.pp
        self.ep_size = train.ep
        self.ep_group = parallel_state.get_expert_model_parallel_group() if train.ep > 1 else None
        self.ep_rank = dist.get_rank(self.ep_group) if train.ep > 1 else 0
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group() if train.ep > 1 else None
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == self.pp_size - 1

        # LoRA hooks need the linears' own input: TE's fused norm-linear hides it, so LoRA runs the local spec
        use_te = transformer_engine_available() and self.device.type == "cuda" and not lora and not batch_invariant
        overrides = dict(train.megatron)
        if train.gradient_checkpointing:
            overrides = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
                         **overrides}
        config = transformer_config(self.arch, tp=train.tp, pp=train.pp, cp=train.cp, device=self.device.type,
                                    use_te=use_te, overrides=overrides, ep=train.ep)
        self.packed = train.pack_sequences
        if problem := megatron_packing_problem(train, self.arch.is_mla):
            raise ValueError(f"train=megatron: {problem}")
        self._packed: PackedBatch | None = None  # the packed layout of the micro-batch in flight
        self.model = build_model(self.arch, config, use_te, self.device, head=self.head)
        load_hf_weights(self.model, model_path, self.arch, head=self.head)
        if batch_invariant:  # and the engine's kernels under deterministic=true (model/invariant.engine_kernels)
            make_invariant(self.model, self.arch.fused_gate_up)
            self._stage, self._head = (engine_kernels()(f) for f in (self._stage, self._head))
        self._routers = {layer.layer_number - 1: layer.mlp.router for layer in self.model.decoder.layers
                         if isinstance(layer.mlp, MoE) and role == "actor"}
        """0-based layer number -> this stage's MoE routers (routing replay; PPO's critic routes itself)."""
        table = stage_table(self.model, self.arch, self.head)
        self._tp_split = {p.megatron for p in table if p.kind != "replicated"}
        low = compute_dtype(train, self.device)
        self.lora = self._attach_lora(low) if lora else None
        if frozen:  # in the compute dtype, as a LoRA base is: no master, gradient or optimizer state
            self.model.requires_grad_(False).to(low)
        self.params = stage_parameters(self.model)
        shared = ("embedding.word_embeddings.weight" if self.first_stage else TIED_COPY.megatron)
        self.gradients = None if frozen else Gradients(
            self.model, self.params, self._tp_split,
            tied_copy=TIED_COPY in table,  # this last stage holds a copy of the first stage's embedding
            shared=(self.params[shared] if train.pp > 1 and self.head == "lm" and self.arch.tie_word_embeddings
                    and (self.first_stage or self.last_stage) else None),
            tp_group=self.tp_group, pp_group=self.pp_group, dp_group=self.dp_group, dp_cp_group=self.dp_cp_group,
            device=self.device, experts={p.megatron for p in table if p.expert is not None} if train.ep > 1 else set(),
            ep_group=self.ep_group, expert_dp_group=self.expert_dp_group)
        self.vocab_start = self.tp_rank * (self.arch.vocab_size // self.tp_size)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._compute = ComputeCopy(self.model, low, trainable) if low != torch.float32 and not frozen else None
        self.pipeline = Pipeline(self._stage, self._activation_shape, self.pp_group, self.device, self._compute)
        self.compiled = not batch_invariant and train.compiles(self.device.type)
        if self.compiled:  # each layer's forward; megatron's recompute (if on) calls it eagerly around the graph
            allow_recompiles(2 * len(self.model.decoder.layers) + 8)  # room for a guard on a per-layer attribute
            for layer in self.model.decoder.layers:
                layer.forward = torch.compile(layer.forward, options=compile_options(train))
        head = packed_logprobs if self.packed else response_logprobs
        head = functools.partial(head, invariant=True) if batch_invariant else head
        self._lm_logprobs = torch.compile(head) if self.compiled else head
        self._keep_from = 0  # the LM head's first position (set per micro-batch; cp=1 only)
        if self.last_stage and self.head == "lm" and self.cp_size == 1 and not config.sequence_parallel:
            self.model.output_layer.register_forward_pre_hook(self._head_input)
            self.model.output_layer.register_forward_hook(self._head_output)
        peak = train.critic_lr if role == "critic" else train.lr
        experts = [self.params[p.megatron] for p in table if p.expert is not None and p.megatron in self.params]
        self.optimizer, self.scheduler = (None, None) if frozen else build_optimizer(
            self.model.parameters(), train, total_steps, peak,  # ZeRO: experts over their expert-DP peers (ep > 1)
            shard_group=self.dp_cp_group if train.distributed_optimizer else None,
            part_groups=[(experts, self.expert_dp_group if train.distributed_optimizer else None)]
            if train.ep > 1 else None)
        self.zero = not frozen and is_sharded(self.optimizer)
        self.step = 0
        self._ref_shards = host_copy(self._reference_shards()) if keep_reference else None

    def _attach_lora(self, low: torch.dtype) -> MegatronLora:
        """Adapters on the targeted linears (lora.py); every base parameter frozen (but the biases train.lora.bias
        names) and, with bf16 compute, kept in bf16 without an fp32 master."""
        lora = MegatronLora(self.model, self.arch, self.train_cfg.lora, self.tp_group,
                            self.pp_group if self.pp_size > 1 else None)
        adapters = lora.parameter_names()
        self._tp_split |= lora.tp_split_names()
        for name, param in stage_parameters(self.model).items():
            if name not in adapters and not trainable_bias(name, self.train_cfg.lora):
                param.requires_grad_(False)
                param.data = param.data.to(low)
        return lora

    def load_adapter(self, adapter_dir: str | Path) -> None:
        """train.lora: set the adapters from a PEFT adapter directory (MegatronLora.load)."""
        if self.lora is None:
            raise ValueError("load_adapter needs train.lora.rank > 0")
        self.lora.load(adapter_dir)

    # ---- forward ----------------------------------------------------------------------------------------------
    def _padded_ids(self, mb: TrainBatch) -> torch.Tensor:
        """[B, L'] input ids, right-padded to a multiple of 2 * cp (L' = L at cp=1): the CP split's unit."""
        ids = mb.input_ids
        if self.cp_size == 1:
            return ids
        return torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], self.cp_size) - ids.shape[1]))

    def _activation_shape(self, mb: TrainBatch) -> tuple[int, int, int]:
        """[s, b, H] hidden states a stage receives for a micro-batch: s positions, this rank's share of the
        (padded) sequence."""
        return self._padded_ids(mb).shape[1] // self.cp_size, mb.size, self.arch.hidden_size

    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        """Row groups. A token budget counts whole sequences, which the cp ranks share: cp x the budget per GPU.
        With ep > 1 the EP peers (other DP or CP ranks of the stage) run every MoE layer's collectives together,
        so each runs as many micro-batches as the one with the most: the extra ones are empty groups ([]), run on
        row 0 with their outputs dropped and a zero loss. Every stage of a replica gets the same count (its EP
        group holds the same DP ranks)."""
        budget = self.train_cfg.max_tokens_per_gpu
        groups = micro_batches(batch, self.train_cfg.micro_batch_samples,
                               None if budget is None else budget * self.cp_size, packed=self.packed)
        if self.ep_size > 1:
            count = torch.tensor([len(groups)], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.ep_group)
            groups += [[] for _ in range(int(count) - len(groups))]
        return groups

    def _stage(self, host: TrainBatch, mb: TrainBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers on a micro-batch (``host``: the same on the host): hidden states [L, B, H] out of every
        stage but the last, whose output is [B, L, V / tp] logits (actor) or [B, L, 1] values (critic). ``hidden``:
        the previous stage's. With cp > 1, L is this rank's chunks of the padded sequence (context_parallel.py);
        right padding + causal attention: real tokens never see the padding."""
        if self.packed:
            return self._stage_packed(host)
        if self.last_stage and self.head == "lm" and self.cp_size == 1:
            self._keep_from = first_predicting_position(host)  # from the host batch
        ids = self._padded_ids(mb)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        if self.cp_size > 1:  # RoPE takes the global positions from megatron's own CP slicing (spec.py)
            ids, positions = (split_sequence(t, 1, self.cp_rank, self.cp_size) for t in (ids, positions))
        if not self.first_stage:
            low = self._compute.dtype if self._compute is not None else hidden.dtype
            self.model.set_input_tensor(hidden.to(low))  # pipeline activations travel in fp32
        if self._routers:
            self._route_as_engine(mb.routed_experts)
        return self.model(ids, positions, None)

    def _stage_packed(self, host: TrainBatch) -> torch.Tensor:
        """_stage on the micro-batch packed into one row (packed.py): [1, K, V / tp] logits of the positions that
        predict response tokens (actor), [1, N, 1] values (critic)."""
        self._packed = packed = pack(host, bucketed=self.train_cfg.cuda_graphs).to(self.device)
        if self._routers:
            self._route_as_engine(packed.routed_experts)
        return self.model(packed.input_ids, packed.position_ids, None, packed_seq_params=thd_params(packed))

    def _route_as_engine(self, experts: torch.Tensor | None) -> None:
        """Routing replay: each MoE router of this stage takes the micro-batch's routed experts for its layer
        (moe.ReplayedChoice), in the [s, b] order of this rank's CP chunks; a batch without them routes anew."""
        if experts is not None and self.cp_size > 1:
            tail = padded_length(experts.shape[1], self.cp_size) - experts.shape[1]
            experts = torch.cat([experts, experts.new_full((experts.shape[0], tail, *experts.shape[2:]), NO_EXPERT)], 1)
            experts = split_sequence(experts, 1, self.cp_rank, self.cp_size)
        flat = None if experts is None else experts.transpose(0, 1).reshape(-1, *experts.shape[2:]).long()
        for layer, router in self._routers.items():
            router.router_replay.target = None if flat is None else flat[:, layer]

    def _head_input(self, module, args):
        """Forward pre-hook of the output layer: hidden states [s, b, H] from the first predicting position on
        (a packed row: at its kept positions), batch-major ([b, s', H], a small copy), so the logits come out
        [b, s', V / tp] contiguous."""
        hidden = args[0][self._packed.keep] if self.packed else args[0][self._keep_from:]
        return (hidden.transpose(0, 1).contiguous(),) + tuple(args[1:])

    @staticmethod
    def _head_output(module, args, output):
        """Forward hook of the output layer: its batch-major logits as the [s', b, V / tp] view GPTModel expects;
        GPTModel's ``transpose(0, 1).contiguous()`` then returns them without copying (B x s' x V: 1.9 GB in bf16
        for 8 x 769 positions of a 152k vocabulary, and again in the backward)."""
        logits, bias = output
        return logits.transpose(0, 1), bias

    def _head(self, out: torch.Tensor, mb: TrainBatch, temperature: float, with_entropy: bool):
        """Last stage: (logp, entropy) [B, T] of the response tokens, identical on every TP rank; the critic's
        (values, None)."""
        if self.cp_size > 1:
            return self._head_context_parallel(out, mb, temperature, with_entropy)
        if self.packed:
            return packed_head(out, self._packed, self, temperature, with_entropy)
        if self.head == "value":
            return response_values(out, mb), None
        first = self._keep_from  # out[:, k] is the output at position first + k
        if self.tp_size == 1:
            return self._lm_logprobs(out, mb, temperature, with_entropy, first)
        length = mb.input_ids.shape[1]
        pos, valid = predicting_positions(mb, length)
        b, t = mb.loss_mask.shape
        picked = torch.gather(out, 1, (pos - first).unsqueeze(-1).expand(b, t, out.shape[-1])).float()
        if temperature != 1.0:
            picked = picked / temperature
        targets = torch.gather(mb.input_ids, 1, (pos + 1).clamp(max=length - 1))
        logp, entropy = vocab_parallel_logprobs(picked, targets, self.vocab_start, self.tp_group, with_entropy)
        return logp * valid, (entropy * valid if with_entropy else None)

    def _head_context_parallel(self, out: torch.Tensor, mb: TrainBatch, temperature: float, with_entropy: bool):
        """_head from this CP rank's chunks ([B, L / cp, .]): the per-position logprobs (and entropy) of every local
        token's successor, or its values, gathered over CP into sequence order (every CP rank holds all of them and
        computes the same loss; the gather's backward keeps this rank's chunks), then the response positions."""
        ids = self._padded_ids(mb)
        length = ids.shape[1]
        if self.head == "value":
            values = gather_sequence(out.float(), self.cp_group, dim=1, reduce_grad=False)
            return response_values(values, mb), None
        local = local_positions(length, self.cp_rank, self.cp_size, ids.device)
        targets = ids[:, (local + 1).clamp(max=length - 1)]
        logits = out.float()
        if temperature != 1.0:
            logits = logits / temperature
        logp, entropy = vocab_parallel_logprobs(logits, targets, self.vocab_start, self.tp_group, with_entropy)
        per_position = torch.stack([logp, entropy] if with_entropy else [logp], dim=-1)
        full = gather_sequence(per_position, self.cp_group, dim=1, reduce_grad=False)  # [B, L', 1 or 2]
        pos, valid = predicting_positions(mb, length)
        picked = torch.gather(full, 1, pos.unsqueeze(-1).expand(-1, -1, full.shape[-1])) * valid.unsqueeze(-1)
        return picked[..., 0], (picked[..., 1] if with_entropy else None)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, policy: str = "current", temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] logprobs (and entropy) of the response tokens under the current or the reference policy; the
        critic returns its values V(s_j) instead. The same on every rank of the replica."""
        if policy == "ref" and self._ref_shards is None:
            raise ValueError("no reference policy kept: construct with keep_reference=True")
        with_entropy = with_entropy and self.head == "lm"
        filled = BatchLogprobs(batch, self.device, with_entropy)
        groups = self._micro_batches(batch)

        def collect(k, mb, out):
            if groups[k]:
                filled.put(groups[k], *self._head(out, mb, temperature, with_entropy))

        reference = policy == "ref"
        with swapped_in(self._reference_shards(), self._ref_shards) if reference else nullcontext(), \
                self.lora.disabled() if reference and self.lora is not None else nullcontext(), self._computing():
            self.model.eval()
            self.pipeline.run([batch.select(idx or [0]) for idx in groups], collect, backward=False)
        logp, ent = filled.host()
        return self.pipeline.from_last_stage(logp), (self.pipeline.from_last_stage(ent) if with_entropy else None)

    # ---- training ---------------------------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float = 1.0,
                   with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; returns averaged metrics + grad_norm, lr."""
        self.model.train()
        with_entropy = with_entropy and self.head == "lm"
        groups = self._micro_batches(batch)
        total_units = loss_units(batch.loss_mask, self.loss_agg).to(self.device, torch.float64)
        dist.all_reduce(total_units, group=self.dp_group)
        hosts = [batch.select(idx or [0]) for idx in groups]  # loss weights from host tensors: no sync in the loop
        weights = [float(loss_units(h.loss_mask, self.loss_agg)) / float(total_units) if idx else 0.0
                   for h, idx in zip(hosts, groups)]
        step_metrics = StepMetrics()

        def aux_loss_scale(k):  # megatron reads it in each MoE layer's backward: this micro-batch's loss weight
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(weights[k] * self.dp_size, device=self.device))

        def loss_of(k, mb, out):
            if not groups[k]:  # an EP peer's extra micro-batch: its backward runs the collectives, adds nothing
                return out.float().sum() * 0.0
            logp, entropy = self._head(out, mb, temperature, with_entropy)
            loss, metrics = loss_fn(logp, entropy, mb)
            step_metrics.add(metrics, weights[k])
            return loss * weights[k] * self.dp_size

        with self._computing():
            self.pipeline.run(hosts, loss_of, backward=True,
                              before_backward=aux_loss_scale if self.arch.moe_aux_loss_coeff > 0 else None)
        self.gradients.reduce()
        grad_norm = self.gradients.norm()
        self._optimizer_state_ready(to_write=True)  # colocated: copies may be in flight (train/offload.py)
        lr = self.scheduler.get_last_lr()[0]
        clip_and_step(self.optimizer, [p.grad for p in self.gradients.params.values()], grad_norm,
                      self.train_cfg.clip_grad)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        values = step_metrics.values()  # read once the optimizer step is queued
        if self.pp_size > 1:  # the metrics were computed on the last stage
            box = [values]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.pp_group, self.pp_size - 1),
                                       group=self.pp_group)
            values = box[0]
        out = StepMetrics.reduce(values, self.dp_group, self.device)
        out.update(grad_norm=float(grad_norm), lr=lr)
        return out

    # ---- weights ----------------------------------------------------------------------------------------------
    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every HF state-dict entry, gathered over TP (an expert on its EP rank, then
        broadcast over the stage's EP group) and broadcast over PP one at a time; every rank gets every tensor.
        Collective: all ranks of this replica, and with ep > 1 every rank (every DP replica yields the same
        tensors)."""
        weights = iter_hf_weights(self.model, self.arch, self.tp_group, self.pp_group if self.pp_size > 1 else None,
                                  head=self.head, ep_group=self.ep_group)
        yield from transformers_names(weights if self.lora is None else self.lora.merged(weights), self.arch)

    def iter_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """train.lora: (adapter key, full A or B) of every adapter, in HF order, gathered over TP and sent to every
        pipeline stage. Collective over the replica's TP and PP groups."""
        if self.lora is None:
            return super().iter_adapter_weights()
        return self.lora.iter_full()

    def export_hf(self, out_dir: str | Path) -> None:
        """Write an HF checkpoint (config + safetensors, in ``export_dtype``) of the current weights; rank 0 writes.
        Collective. The critic exports as *ForTokenClassification with one label."""
        if self.ep_size > 1 or (self.dp_rank == 0 and self.cp_rank == 0):  # one replica gathers (EP: all)
            state = {name: tensor.cpu() for name, tensor in self.iter_full_weights()}
            if dist.get_rank() == 0:
                if self.head == "value":
                    config = AutoConfig.from_pretrained(self.model_path, num_labels=1)
                    net = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
                else:
                    net = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
                net.load_state_dict(state, strict=True)
                if self.hf_config.tie_word_embeddings and self.head == "lm":
                    net.tie_weights()
                net.to(export_dtype(self.hf_config)).save_pretrained(out_dir, safe_serialization=True)
        dist.barrier()

    # ---- checkpoint -------------------------------------------------------------------------------------------
    def save(self, ckpt_dir: str | Path, background: bool = False) -> None:
        """Resumable checkpoint (checkpoint.py): this (PP stage, TP rank) slot's parameters, optimizer and reference
        shards; scheduler, step; every rank's RNG; ``background``: written by a thread from a host copy."""
        self._optimizer_state_ready()
        checkpoint.save(self, ckpt_dir, background)

    def load(self, ckpt_dir: str | Path, weights_only: bool = False) -> None:
        checkpoint.load(self, ckpt_dir, weights_only)

    # ---- reference swap ---------------------------------------------------------------------------------------
    def _local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every trainable parameter, by name (all of them without train.lora)."""
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def _reference_shards(self) -> dict[str, torch.Tensor]:
        """The trainable parameters the reference policy swaps back to their initial values: every one in full
        training; with train.lora only the trained biases (the adapters are switched off instead)."""
        adapters = {id(p) for p in self.lora.parameters()} if self.lora is not None else set()
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad and id(p) not in adapters}
