"""Train group schema: backend, parallelism, batch sizes in samples, optimizer, weight sync.

Batch arithmetic (checked in config/rules.py, derived in config/derive.py):
  rollout.batch_prompts * rollout.n_samples_per_prompt = global_batch_samples * optimizer_steps_per_rollout
  dp = num_gpus / (tp * pp * cp);  global_batch_samples % (micro_batch_samples * dp) == 0
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

from slime_hydra.options import Problem, choice, non_negative, positive, within
from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS

TRAIN_DTYPES = ("bf16", "fp32")
"""train.dtype: compute precision (train/precision.py)."""
LR_DECAY_STYLES = ("constant", "linear", "cosine")
"""train.lr_decay_style: schedules after warmup (train/optim.py)."""
WEIGHT_SYNC_METHODS = ("distributed", "tensor", "disk")
"""How weights reach the engines (train/weight_sync.py); train.weight_sync may also say ``auto``."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""train.lora.target_modules: the decoder's linear layers by their HF module names (Llama / Qwen2 / Qwen3 / GLM-4
spelling); train=megatron adapts the fused linear_qkv / linear_fc1 as the same per-module adapters."""
LORA_BIAS = ("none", "all", "lora_only")
"""train.lora.bias: which biases train beside the adapters (PEFT's ``bias``)."""
LORA_SYNC = ("merged", "adapter")
"""How a LoRA policy reaches the engines: W + scale * B A merged into full weights, or the adapter alone."""


@dataclass
class LoraConfig:
    """LoRA (train/lora.py): the base weights frozen, each targeted linear W x becomes W x + (alpha / rank) B A x
    with A [rank, in] (random) and B [out, rank] (zeros: at step 0 the policy is the base model). Only A, B (and
    the biases ``bias`` names) carry gradients and optimizer state; the reference policy is the base model with the
    adapter switched off."""

    rank: int = non_negative(0)
    """Adapter rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = positive(32.0)
    """Scale numerator: the update is (alpha / rank) * B A."""
    dropout: float = within(0.0, 0.0, 1.0, high_open=True)
    """Dropout on the adapter's input while training (logprobs and rollout never drop)."""
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Linear layers that get adapters, among LORA_TARGETS."""
    bias: str = choice("none", LORA_BIAS)
    """none | all (every bias trains) | lora_only (biases of adapted layers train)."""
    sync: str = choice("auto", ("auto",) + LORA_SYNC)
    """auto (adapter to embedded engines on GPUs of their own when only the adapters train, else merged) | merged
    (W + scale * B A, any engine) | adapter (A and B only: the embedded engine computes W x + scale * B A x at run
    time)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if not self.enabled:
            return
        if not self.target_modules:
            yield Problem((f"{prefix}target_modules",), "LoRA with no target module adapts nothing",
                          f"set {prefix}target_modules=[q_proj,v_proj] (or any of {', '.join(LORA_TARGETS)})")
        for i, name in enumerate(self.target_modules):
            if name not in LORA_TARGETS:
                yield Problem((f"{prefix}target_modules.{i}",), f"'{name}' is not a decoder linear layer",
                              f"choose among {', '.join(LORA_TARGETS)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            yield Problem((f"{prefix}target_modules",), f"{list(self.target_modules)} names a module twice",
                          "list each module once")


def megatron_moe_problems(train: "TrainConfig", num_experts: int) -> list[Problem]:
    """What train=megatron refuses for expert parallelism and MoE models (train/megatron/moe.py): the backend checks
    them at construction with its checkpoint's expert count, config/rules.py before anything starts with the model
    config's. num_experts: routed experts per MoE layer (0: dense). (LoRA on a MoE model adapts its attention:
    config/rules.check_lora refuses expert targets for both backends.)"""
    t, out = train, []
    dp = t.num_gpus // t.model_parallel_size
    if t.ep > 1 and not num_experts:
        out.append(Problem(("train.ep",), f"expert parallelism (train.ep={t.ep}) needs a MoE model; this one is dense",
                           "set train.ep=1"))
    elif t.ep > 1 and (num_experts % t.ep or (dp * t.cp) % t.ep):
        out.append(Problem(("train.ep", "model.num_experts", "train.num_gpus", "train.cp"),
                           f"train.ep={t.ep} must divide the experts per layer ({num_experts}) and the data-parallel "
                           f"size ({dp}) x train.cp ({t.cp}) (EP peers are the data- and context-parallel ranks of "
                           f"one pipeline stage)",
                           f"choose train.ep among the common divisors of {num_experts} and {dp * t.cp}"))
    if t.ep > 1 and t.compile:
        out.append(Problem(("train.compile", "train.ep"), f"compiled layers under expert parallelism (train.ep={t.ep}) "
                           "computed wrong gradients on an H200 (EP2: grad norm 1.372 where eager and EP1 give 1.717)",
                           "set train.compile=null (eager under train.ep > 1) or false"))
    return out


def megatron_lora_problems(lora: LoraConfig, tp: int, kv_groups: int, fused_gate_up: bool,
                           qkv_bias: bool, megatron: Dict[str, Any]) -> list[Problem]:
    """What train=megatron refuses with train.lora on (train/megatron/lora.py): the backend checks them at
    construction with its model's facts, config/rules.py before anything starts with the model config's.

    kv_groups: query groups (KV heads); fused_gate_up: the family's MLP is one gate_up_proj; qkv_bias: q/k/v carry
    a (fused) bias."""
    out, targets = [], set(lora.target_modules)
    qkv = targets & {"q_proj", "k_proj", "v_proj"}
    if fused_gate_up and targets & {"gate_proj", "up_proj"}:
        out.append(gate_up_problem())
    if kv_groups % tp and qkv:
        out.append(Problem(("train.lora.target_modules", "train.tp"), f"LoRA on q/k/v needs whole query groups per "
                           f"TP rank: {kv_groups} groups over train.tp={tp}",
                           f"choose a train.tp dividing {kv_groups}, or drop q/k/v_proj from the targets"))
    if lora.dropout > 0 and tp > 1:
        out.append(Problem(("train.lora.dropout", "train.tp"), f"train.lora.dropout={lora.dropout} with train.tp={tp}: "
                           "a column-parallel adapter needs the same dropout mask on every TP rank",
                           "set train.lora.dropout=0 or train.tp=1"))
    if lora.bias == "lora_only" and qkv_bias and qkv and len(qkv) < 3:
        out.append(Problem(("train.lora.bias", "train.lora.target_modules"), f"train.lora.bias=lora_only with "
                           f"{sorted(qkv)} of q/k/v: megatron holds one fused q/k/v bias",
                           "target all three, or set train.lora.bias=none or all"))
    if megatron.get("sequence_parallel"):
        out.append(Problem(("train.lora.rank", "train.megatron.sequence_parallel"), "LoRA with sequence parallelism: "
                           "the adapters take the full sequence", "drop train.megatron.sequence_parallel"))
    return out


def megatron_packing_problem(train: "TrainConfig", mla: bool) -> Problem | None:
    """What train=megatron refuses with train.pack_sequences (train/megatron/packed.py: one THD row per micro-batch,
    RoPE and attention per sequence): context or pipeline parallelism, sequence parallelism and multi-latent
    attention. The backend checks it at construction, config/rules.py before anything starts. mla: the model has
    multi-latent attention."""
    t, sequence_parallel = train, bool(train.megatron.get("sequence_parallel"))
    if not t.pack_sequences or not (t.cp > 1 or t.pp > 1 or sequence_parallel or mla):
        return None
    extras = (" with multi-latent attention" if mla else "") + (" with sequence_parallel" if sequence_parallel else "")
    return Problem(("train.pack_sequences", "train.cp", "train.pp", "train.megatron.sequence_parallel"),
                   f"train=megatron packs sequences with cp=1, pp=1, no sequence_parallel and no multi-latent "
                   f"attention, not cp={t.cp} pp={t.pp}{extras}", "set train.pack_sequences=false, or use train=fsdp")


def gate_up_problem() -> Problem:
    """The family's MLP holds gate and up as one ``gate_up_proj`` (GLM-4): no gate_proj / up_proj to adapt."""
    return Problem(("train.lora.target_modules", "model.family"), "this family stores gate and up as one "
                   "gate_up_proj, which the names gate_proj / up_proj do not match",
                   "drop gate_proj and up_proj from train.lora.target_modules")


@dataclass
class TrainConfig:
    backend: str = choice("fsdp", TRAIN_BACKEND_KINDS)
    """The trainer implementation (train/kinds.py): fsdp (torch-native FSDP2 over the HF model) | megatron
    (megatron-core GPTModel)."""
    num_gpus: int = positive(1)
    """Training ranks (GPUs; on a CPU-only machine, CPU processes)."""
    tp: int = positive(1)
    """Tensor-parallel size (megatron only)."""
    pp: int = positive(1)
    """Pipeline-parallel size (megatron only)."""
    cp: int = positive(1)
    """Context-parallel size (megatron only)."""
    ep: int = positive(1)
    """Expert-parallel size for MoE models (megatron only; divides the data-parallel ranks)."""
    global_batch_samples: Optional[int] = positive(None)
    """Samples per optimizer step; null derives it from the rollout batch and optimizer_steps_per_rollout."""
    optimizer_steps_per_rollout: Optional[int] = positive(None)
    """Optimizer steps taken on one rollout batch; null derives it (1 when global_batch_samples is null too)."""
    micro_batch_samples: int = positive(1)
    """Samples per forward/backward on one rank (gradient accumulation makes up the rest)."""
    max_tokens_per_gpu: Optional[int] = positive(None)
    """Dynamic micro-batching: pack sequences up to this many tokens per forward; null uses micro_batch_samples."""
    pack_sequences: bool = False
    """Padding-free micro-batches: a micro-batch's sequences run back to back as one row with variable-length
    attention, and the LM head only where a response token is predicted (train/packing.py; train=megatron with cp=1,
    pp=1). With max_tokens_per_gpu the budget counts real tokens, balanced over the micro-batches."""
    lr: float = positive(1e-6)
    """Peak learning rate of the policy."""
    critic_lr: float = positive(1e-5)
    """Peak learning rate of the critic (PPO only)."""
    min_lr: float = non_negative(0.0)
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = non_negative(0)
    """Linear warmup in optimizer steps."""
    lr_decay_style: str = choice("constant", LR_DECAY_STYLES)
    """constant | linear | cosine (after warmup)."""
    weight_decay: float = non_negative(0.0)
    """AdamW decoupled weight decay."""
    adam_beta1: float = within(0.9, 0.0, 1.0, high_open=True)
    """AdamW beta1."""
    adam_beta2: float = within(0.98, 0.0, 1.0, high_open=True)
    """AdamW beta2."""
    adam_eps: float = positive(1e-8)
    """AdamW epsilon."""
    clip_grad: float = non_negative(1.0)
    """Global gradient-norm clip; 0 disables."""
    dtype: str = choice("bf16", TRAIN_DTYPES)
    """Compute dtype of training: bf16 | fp32 (CPU runs use fp32)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile: Optional[bool] = None
    """torch.compile each decoder layer's forward (train=fsdp: HF's decoder layers; train=megatron: each
    TransformerLayer) and the logprob head (fewer, fused kernels; the first steps pay the compile). null: on when
    training on CUDA, off on CPU (inductor's C++ compile is slow there) and under expert parallelism (``compiles``)."""
    compile_eager_numerics: bool = True
    """With train.compile and bf16: the compiled layers round to bf16 after every op, as the engines' eager kernels
    do (inductor's emulate_precision_casts), so the trainer's logprobs are those of the distribution the engines
    sampled from. false lets inductor keep fp32 between fused ops: a little more precise and a different function
    from the engines' (on one H100, the tiny default's train-vs-rollout logprob gap was 0.01 nats per token that
    way, 2e-7 in eager bf16; docs/benchmarks.md)."""
    cuda_graphs: bool = False
    """With train.compile on CUDA: replay each compiled decoder layer (forward and backward) as a CUDA graph
    (torch.compile mode="reduce-overhead": one launch per layer instead of dozens; +12% on one H100 for a 0.5B
    model, docs/benchmarks.md). One graph is recorded per micro-batch shape (packed rows' shapes are bucketed,
    packing._bucket); refused when colocated."""
    distributed_optimizer: bool = True
    """train=megatron: shard the Adam state over the data-parallel (and context-parallel) peers, ZeRO stage 1
    (megatron's --use-distributed-optimizer; here torch's ZeroRedundancyOptimizer, train/optim.py). Nothing to
    shard with a single such peer."""
    weight_sync: str = choice("auto", ("auto",) + WEIGHT_SYNC_METHODS)
    """auto (tensor when colocated, distributed otherwise) | tensor | distributed | disk."""
    weight_sync_bucket_mb: int = positive(512)
    """Size bound of one weight-sync bucket in MiB."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters in place of full fine-tuning (off while lora.rank is 0)."""
    megatron: Dict[str, Any] = field(default_factory=dict)
    """Passthrough megatron-core TransformerConfig fields (recompute_granularity, num_layers_in_first_pipeline_stage
    ...), given to the backend's TransformerConfig; names and value types checked against that dataclass."""

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    def compiles(self, device_type: str) -> bool:
        """Whether the backends compile the decoder layers on a ``device_type`` device: ``compile``, or where it is
        null on CUDA only, and never under expert parallelism (``ep`` > 1): compiled, train=megatron's EP2 step
        computed other gradients than eager and EP1 on two H200s (grad norm 1.372 against 1.717; the loss agreed;
        docs/benchmarks.md), so those layers run eagerly (megatron_moe_problems refuses compile=true there)."""
        if self.compile is not None:
            return self.compile
        return device_type == "cuda" and self.ep == 1

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.min_lr > self.lr:
            yield Problem((f"{prefix}min_lr", f"{prefix}lr"),
                          f"min_lr={self.min_lr} is above lr={self.lr}: the decay would raise the learning rate",
                          f"set {prefix}min_lr to at most {self.lr} (0 decays to zero)")
