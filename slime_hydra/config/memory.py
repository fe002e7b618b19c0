"""The memory plan: what each role holds on a GPU and in host RAM, from the config alone, before anything starts.

``plan_memory(cfg, d)`` gives, per GPU, the trainer rank's and the engine's peak (and, colocated, the GPU's: the two
take turns, so the larger of the two plus what the other keeps; or, where ``cluster.colocate_offload`` resolves to
no moves, both), and per node the host RAM (reference copies, offload buffers, parked engine weights, and on a
CPU-only machine everything). ``memory_problems`` refuses a plan that does not fit ``cluster.gpu_memory_gb`` / the
node's host RAM, with the numbers, the smallest GPU that fits and the overrides that would make it fit (each
re-planned, so the list is true).

Estimates, in bytes (P = parameters of this rank's shard, T = tokens of one micro-batch on this rank, K = the
positions whose logits are computed, V = vocabulary, L = layers, H = hidden, F = MLP width, h / g / d = query
heads / KV heads / head dim):

    trainer static      P x (4 fp32 master + 4 fp32 grad + 8 Adam / ZeRO peers) + P x 2 bf16 compute copy + P x 2
                        its gradients (GPU, bf16; added into the fp32 grads after the backward); a MoE layer's
                        routed experts count E x 3HF' (F' one expert's width), split by megatron over TP x EP with
                        their Adam state over DP x CP / EP peers, its S shared experts S x 3HF' (split like a dense
                        MLP), its router E x H; the first_dense_layers hold a dense MLP (3HF) instead; a pipeline
                        stage is counted as if all its layers were MoE layers (the busiest)
    with train.lora     P x 2 (bf16; 4 fp32) frozen base + A_P x (4 fp32 adapter + 4 grad + 8 Adam / ZeRO peers),
                        A_P = rank x sum of (in + out) over the adapted linears, no compute copy; activations add
                        the adapters' fp32 inputs (4 x in bytes per token and adapted linear: PEFT upcasts x for
                        each one); no reference copy (the reference is the base, adapter off)
    algo=opd teacher    P_t x 2 (bf16; 4 fp32) frozen weights in every trainer rank (P_t: the teacher's parameters,
                        split as the student's: FSDP over DP, megatron over TP x PP; read off its option or
                        config.json, model/teacher.py); moved to the host with the trainer when colocated
    multi-latent attn.  its projections (q_a, q_b or q, kv_a with the shared RoPE key, kv_b, o) instead of q/k/v/o;
                        activations its latents (2 (q_lora + kv_lora + rope) bytes, not split over TP) and q, k
                        (h (nope + rope) each), v (h v_head_dim) in place of the q/k/v terms; the engine caches keys
                        and values expanded to every head (h (nope + rope + v_head_dim) per token and layer)
    activations         T x L_stage x a,  a = 8H + 2(h + 2g)d + 2(h + g)d + 2hd + 8F  bytes per token and layer in
                        bf16 (the tensors autograd keeps: norms, q/k/v before and after RoPE, attention out, the
                        MLP's gate / up / act / product; MoE: F = F' x (k + S) for the k routed and S shared
                        experts a token meets); TP divides the head and F terms; x2 in fp32; with
                        recomputation 2H per token and layer plus one layer's full set; PP: the first stage keeps
                        min(pp, micro-batches) in flight
    logits              K x V / tp x 4 bytes compiled (bf16 logits and their grad; the fp32 logsumexp is fused),
                        x 20 eager (fp32 temporaries), measured on an H100 (docs/benchmarks.md)
    engine              weights P x 2 (bf16) / gpus_per_engine; KV cache (slots + 1) x capacity x L x 2 x g x d x 2
                        with capacity the power of two above prompt + response (the embedded engine's slots and its
                        scratch slot); decode logits and CUDA-graph outputs; on a GPU the prefill graphs' pool,
                        PREFILL_GRAPH_TOKENS x (4H + 3F) x 2 (hidden states, q/k/v and attention out; the MLP's
                        gate, up and product); SGLang takes rollout.sglang.mem_fraction_static of the GPU
    host                the reference policy (4 bytes / param of each rank's shard, pinned), colocated offload
                        buffers (the trainer's masters + Adam state) and parked engine weights, with
                        checkpoint_in_background the checkpoint's host copy (12 bytes / param of each rank's shard:
                        fp32 masters and Adam's moments, kept from one save to the next; under ZeRO the writing DP
                        rank holds the consolidated moments), 0.3 GiB per torch process (0.6 with CUDA) and 0.6 GiB
                        of Ray services; on a CPU-only machine the trainer and engines themselves, in fp32

plus ``CUDA_RESERVE`` per GPU (context, cuBLAS workspaces, allocator slack). Calibrated against torch's peak
allocation on an H100 (docs/benchmarks.md, "The memory plan against measurement").
"""

import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from slime_hydra.config.derive import Derived, derive
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Problem
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS
from slime_hydra.rollout.engines.embedded import PREFILL_GRAPH_TOKENS, cache_capacity

GiB = 2 ** 30
CUDA_RESERVE = 1.5 * GiB
"""Per GPU beyond what torch allocates: the CUDA context (~0.5 GiB), cuBLAS/NCCL workspaces, allocator slack."""
RESIDENT_FRACTION = 0.9
"""cluster.colocate_offload=auto keeps trainer and engines resident when both peaks fit this fraction of a GPU (the
plan is an estimate, and two processes' caching allocators fragment more than one)."""
PROCESS_HOST = {False: 0.3 * GiB, True: 0.6 * GiB}
"""Host RAM (PSS) of one Python process with torch, besides its model (the driver, a rank, an engine, the rollout
manager): 0.29-0.34 GiB measured on the CPU machine; with CUDA (its libraries and context) assumed twice that."""
RAY_SERVICES_HOST = 0.6 * GiB
"""Host RAM (PSS) of Ray's per-node services (GCS, raylet, dashboard and its agents, monitors) and the router:
0.58 GiB measured on the CPU machine (docs/benchmarks.md)."""
LOGIT_BYTES = {True: 4, False: 20}
"""Bytes per computed logit in a training step: compiled (bf16 logits + grad) or eager (fp32 temporaries)."""


@dataclass(frozen=True)
class Params:
    """Parameter counts of the model option (from its architecture numbers)."""

    per_layer: int
    """All of one decoder layer's parameters (a MoE layer's: the routed experts included)."""
    embedding: int
    head: int
    final_norm: int
    experts_per_layer: int = 0
    """The routed experts' part of per_layer (megatron splits them over the EP ranks)."""
    dense_layers: int = 0
    """Layers of a MoE model holding a dense MLP instead (the first ones)."""
    dense_layer: int = 0
    """All of one such dense layer's parameters."""

    def total(self, layers: int) -> int:
        return (self.per_layer * (layers - self.dense_layers) + self.dense_layer * self.dense_layers
                + self.embedding + self.head + self.final_norm)


def _mlp_width(m) -> int:
    """The MLP width a token meets in one layer: ffn_hidden_size, or for MoE moe_ffn_hidden_size x (top-k routed +
    shared experts)."""
    if not m.is_moe:
        return m.ffn_hidden_size
    return (m.moe_ffn_hidden_size or m.ffn_hidden_size) * (max(m.moe_top_k, 1) + m.moe_shared_experts)


def adapted_dims(cfg: SlimeConfig) -> list[tuple[int, int]]:
    """(in, out) of each linear train.lora adapts in one decoder layer (a dense MLP's widths)."""
    m = cfg.model
    h, g, d, hidden, ffn = m.num_attention_heads, m.num_kv_heads, m.kv_channels, m.hidden_size, m.ffn_hidden_size
    dims = {"q_proj": (hidden, h * d), "k_proj": (hidden, g * d), "v_proj": (hidden, g * d), "o_proj": (h * d, hidden),
            "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn), "down_proj": (ffn, hidden)}
    return [dims[name] for name in cfg.train.lora.target_modules if name in dims]


def _latent_attention(m) -> int:
    """Multi-latent attention's parameters (model/config.py's widths): the query path (H x q_lora + its norm +
    q_lora x h(nope + rope), or H x h(nope + rope) uncompressed), the key/value latent with the shared RoPE key
    (H x (kv_lora + rope) + its norm), its up projection kv_lora x h(nope + v), the output h v x H."""
    h, hidden = m.num_attention_heads, m.hidden_size
    q_lora, kv_lora, nope, rope, v = (m.q_lora_rank or 0, m.kv_lora_rank or 0, m.qk_nope_head_dim or 0,
                                      m.qk_rope_head_dim or 0, m.v_head_dim or 0)  # a missing one: its own problem
    query = (hidden * q_lora + q_lora + q_lora * h * (nope + rope)) if q_lora else hidden * h * (nope + rope)
    return query + hidden * (kv_lora + rope) + kv_lora + kv_lora * h * (nope + v) + h * v * hidden


def param_counts(cfg: SlimeConfig) -> Params:
    m = cfg.model
    h, g, d, hidden = m.num_attention_heads, m.num_kv_heads, m.kv_channels, m.hidden_size
    attention = hidden * h * d + 2 * hidden * g * d + h * d * hidden + (h + 2 * g) * d  # + q/k/v biases
    if m.is_mla:
        attention = _latent_attention(m)
    dense = 3 * hidden * m.ffn_hidden_size
    expert = 3 * hidden * (m.moe_ffn_hidden_size or 0)
    experts = m.num_experts * expert
    mlp = experts + m.moe_shared_experts * expert + hidden * m.num_experts if m.is_moe else dense  # + the router
    embedding = m.vocab_size * hidden
    return Params(per_layer=attention + mlp + 4 * hidden, embedding=embedding,
                  head=0 if m.tie_word_embeddings else embedding, final_norm=hidden, experts_per_layer=experts,
                  dense_layers=m.first_dense_layers if m.is_moe else 0, dense_layer=attention + dense + 4 * hidden)


@dataclass
class Usage:
    """What one role holds, by part (bytes)."""

    role: str
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.parts.items() if v >= 0.05 * GiB)
        return f"{self.role}: {self.total / GiB:.1f} GiB ({parts})"


@dataclass
class MemoryPlan:
    gpu: list[Usage]
    """Per GPU kind: the trainer rank, the engine, and (colocated) the shared GPU; each with CUDA_RESERVE."""
    host: Usage
    """Host RAM of the busiest node."""
    gpu_capacity: Optional[float]
    """Bytes per GPU (cluster.gpu_memory_gb), None when unknown."""
    host_capacity: Optional[float]
    """Bytes of host RAM per node (cluster.mem_gb, or this machine's), None when unknown."""
    on_gpu: bool
    colocated_moves: Optional[bool] = None
    """Colocated on GPUs: whether memory moves at each switch (cluster.colocate_offload resolved); else None."""

    @property
    def gpu_peak(self) -> float:
        return max((u.total for u in self.gpu), default=0.0)

    def lines(self) -> list[str]:
        cap = lambda c: "unknown" if c is None else f"{c / GiB:.0f} GiB"  # noqa: E731
        out = [f"per GPU ({cap(self.gpu_capacity)}): " + u.line() for u in self.gpu]
        out.append(f"host RAM per node ({cap(self.host_capacity)}): " + self.host.line())
        return out


def _tokens(cfg: SlimeConfig, d: Derived) -> tuple[int, int]:
    """(T, K): tokens of one micro-batch on a trainer rank, and the positions whose logits it computes."""
    t, context = cfg.train, d.context_tokens
    cp = t.cp if "cp" in TRAIN_BACKEND_KINDS[t.backend].parallelism else 1  # a rank holds 1 / cp of each sequence
    tokens = t.max_tokens_per_gpu * cp if t.max_tokens_per_gpu else t.micro_batch_samples * context
    samples = max(tokens // max(context, 1), 1)
    return tokens // cp, samples * cfg.rollout.max_response_tokens


def trainer_usage(cfg: SlimeConfig, d: Derived, role: str = "trainer rank") -> Usage:
    """One training rank's peak during a step (on the GPU; in host RAM on a CPU-only machine)."""
    m, t = cfg.model, cfg.train
    on_gpu = cfg.cluster.gpus_per_node > 0
    bf16 = on_gpu and t.dtype == "bf16"
    counts = param_counts(cfg)
    megatron = TRAIN_BACKEND_KINDS[t.backend].sharding == "model_parallel"
    layers = math.ceil(m.num_layers / t.pp) if megatron else m.num_layers
    if megatron:  # the busiest stage: its layers, the embedding (first) and the head (last), split over TP; the
        # routed experts over TP x EP, their Adam state over the DP x CP ranks that hold the same experts (/ EP);
        # with pp > 1 every layer of the stage counted as a MoE layer, the dense first ones being on the first stage
        dense = counts.dense_layers if t.pp == 1 else 0
        experts = counts.experts_per_layer * (layers - dense) / (t.tp * t.ep)
        params = (counts.per_layer * (layers - dense) + counts.dense_layer * dense
                  - counts.experts_per_layer * (layers - dense)
                  + (counts.embedding + counts.head if t.pp == 1 else counts.embedding)) / t.tp + experts
        peers = d.dp * t.cp if t.distributed_optimizer else 1
        adam_peers = params / ((params - experts) / peers + experts / max(peers // t.ep, 1))
        shard = 1
    else:
        params = counts.total(m.num_layers)
        adam_peers, shard = 1, d.dp
    usage = Usage(role)
    lora = t.lora.enabled and role == "trainer rank"  # PPO's critic trains fully
    if lora:
        adapters = t.lora.rank * sum(i + o for i, o in adapted_dims(cfg)) * layers / (t.tp if megatron else 1)
        usage.parts["frozen base"] = params * (2 if bf16 else 4) / shard
        usage.parts["fp32 adapters + grads"] = adapters * 8 / shard
        usage.parts["Adam state"] = adapters * 8 / shard / adam_peers
    else:
        usage.parts["fp32 masters + grads"] = params * 8 / shard
        usage.parts["Adam state"] = params * 8 / shard / adam_peers
    if bf16 and not lora:
        usage.parts["bf16 compute copy"] = params * 2 / shard if (megatron or d.dp == 1) else (
            4 * counts.per_layer * 2)  # FSDP2: two layers unsharded at a time (prefetch)
        usage.parts["bf16 gradients"] = params * 2 / shard  # the compute copy's, added into the fp32 grads after
    tokens, logits = _tokens(cfg, d)
    h, g, dim, hidden = m.num_attention_heads, m.num_kv_heads, m.kv_channels, m.hidden_size
    width = _mlp_width(m)
    tp = t.tp if megatron else 1
    per_token = 8 * hidden + (2 * (h + 2 * g) * dim + 2 * (h + g) * dim + 2 * h * dim + 8 * width) / tp
    if m.is_mla:  # the latents (whole on every TP rank), then q, k, v, q and k after RoPE, the attention output
        v = h * (m.v_head_dim or 0)
        per_token = (8 * hidden + 2 * ((m.q_lora_rank or 0) + (m.kv_lora_rank or 0) + (m.qk_rope_head_dim or 0))
                     + (2 * (2 * h * dim + v) + 2 * 2 * h * dim + 2 * v + 8 * width) / tp)
    scale = 1 if bf16 else 2
    if lora and bf16:  # PEFT's fp32 copy of each adapted linear's input (scale 2 in fp32 counts it already)
        per_token += 4 * sum(i for i, _ in adapted_dims(cfg)) / tp
    if t.gradient_checkpointing:
        act = tokens * (2 * hidden * layers + per_token) * scale
    else:
        act = tokens * per_token * layers * scale
    in_flight = min(t.pp, max(d.grad_accum_steps, 1)) if megatron else 1
    usage.parts["activations"] = act * in_flight
    compiled = t.compiles("cuda" if on_gpu else "cpu")
    usage.parts["logits"] = logits * m.vocab_size / tp * LOGIT_BYTES[bool(compiled and on_gpu)] * (1 if bf16 else 2)
    teacher = _teacher(cfg) if role == "trainer rank" else None
    if teacher is not None:
        split = t.tp * t.pp if megatron else d.dp
        usage.parts["teacher weights"] = param_counts(replace(cfg, model=teacher)).total(teacher.num_layers) * (
            2 if bf16 else 4) / split
    return usage


def _teacher(cfg: SlimeConfig):
    """algo=opd: the teacher's ModelConfig; None without one, or when it cannot be read (config/files.py says why)."""
    from slime_hydra.model.teacher import teacher_option

    if not cfg.algo.distills or cfg.algo.teacher.path is None:
        return None
    try:
        return teacher_option(cfg.algo.teacher.path)
    except (OSError, ValueError):
        return None


def engine_usage(cfg: SlimeConfig, d: Derived) -> Usage:
    """One engine GPU's peak while generating (an embedded engine: weights, slot KV cache, decode outputs)."""
    m, r = cfg.model, cfg.rollout
    usage = Usage("engine")
    counts = param_counts(cfg)
    if ENGINE_KINDS[r.backend].memory == "fraction":
        fraction = float(r.sglang.get("mem_fraction_static") or 0.88)  # SGLang's default for large GPUs
        capacity = _gpu_capacity(cfg)
        if capacity is not None:  # SGLang takes this share of the GPU whatever the model needs
            usage.parts[f"SGLang mem_fraction_static {fraction}"] = fraction * capacity
        return usage
    on_gpu = cfg.cluster.gpus_per_node > 0
    width = 2 if on_gpu and cfg.train.dtype == "bf16" else 4
    usage.parts["weights"] = counts.total(m.num_layers) * width / r.gpus_per_engine
    # the router may send every request of a step to one engine (cache-aware routing keeps a prompt's group together)
    slots = min(r.batch_prompts * r.n_samples_per_prompt, r.max_concurrency_per_engine)
    capacity = cache_capacity(d.context_tokens, m.max_position_embeddings)
    head = m.kv_channels + ((m.v_head_dim or 0) if m.is_mla else m.kv_channels)  # a key's and a value's width
    kv = (slots + 1) * capacity * m.num_layers * m.num_kv_heads * head * width  # + the scratch slot
    usage.parts["KV cache"] = kv * 1.5  # growing to the next power of two keeps the old cache until copied
    usage.parts["decode logits + graph outputs"] = 3 * slots * m.vocab_size * 4
    if on_gpu:  # a prefill graph's pool holds one layer's live tensors for PREFILL_GRAPH_TOKENS tokens
        usage.parts["prefill graphs"] = PREFILL_GRAPH_TOKENS * (4 * m.hidden_size + 3 * _mlp_width(m)) * width
    return usage


def _gpu_capacity(cfg: SlimeConfig) -> Optional[float]:
    """cluster.gpu_memory_gb, or on a local GPU machine what nvidia-smi reports for its first GPU."""
    if cfg.cluster.gpu_memory_gb:
        return cfg.cluster.gpu_memory_gb * GiB
    if cfg.cluster.scheduler == "local" and cfg.cluster.gpus_per_node > 0:
        import subprocess

        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            return float(out.stdout.split()[0]) * 2 ** 20 if out.returncode == 0 and out.stdout.split() else None
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return None
    return None


def _host_capacity(cfg: SlimeConfig) -> Optional[float]:
    if cfg.cluster.mem_gb:
        return cfg.cluster.mem_gb * GiB
    if cfg.cluster.scheduler == "local":
        import os

        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return None


def plan_memory(cfg: SlimeConfig, d: Derived) -> MemoryPlan:
    on_gpu = cfg.cluster.gpus_per_node > 0
    trainer = trainer_usage(cfg, d)
    engine = engine_usage(cfg, d) if cfg.debug.mode != "train_only" else Usage("engine")
    lora = "fp32 adapters + grads" in trainer.parts
    trained = trainer.parts["fp32 adapters + grads" if lora else "fp32 masters + grads"] / 8
    ranks_per_node = min(d.train_gpus, d.gpus_per_node) if on_gpu else -(-d.train_gpus // d.nodes)
    engines_per_node = min(d.num_engines, d.gpus_per_node) if on_gpu else -(-d.num_engines // d.nodes)
    host = Usage("host")
    processes = ranks_per_node + engines_per_node + 2  # + the driver and the rollout manager
    host.parts["processes"] = processes * PROCESS_HOST[on_gpu] + RAY_SERVICES_HOST
    if cfg.algo.needs_reference and not lora:  # under LoRA the reference is the base with the adapter off
        host.parts["reference copies"] = ranks_per_node * trained * 4
    if cfg.checkpoint_in_background:  # train/checkpoint_writer.py
        host.parts["checkpoint copy"] = ranks_per_node * trained * 12
    gpus: list[Usage] = []
    capacity, moves = _gpu_capacity(cfg), None
    if on_gpu:
        for usage in (trainer, engine):
            usage.parts["CUDA reserve"] = CUDA_RESERVE
        if cfg.cluster.colocate:
            policy = cfg.cluster.colocate_offload
            resident = trainer.total + engine.total
            moves = policy == "always" or (policy == "auto" and (capacity is None
                                                                 or resident > RESIDENT_FRACTION * capacity))
            if moves:
                shared = Usage("colocated GPU (trainer and engine take turns)")
                shared.parts.update({"the larger of the two": max(trainer.total, engine.total) - CUDA_RESERVE,
                                     "CUDA reserve (two processes)": 2 * CUDA_RESERVE})
                host.parts["trainer offload"] = ranks_per_node * (trained * 4 + trainer.parts["Adam state"]
                                                                  + trainer.parts.get("frozen base", 0.0)
                                                                  + trainer.parts.get("teacher weights", 0.0))
                host.parts["parked engine weights"] = engines_per_node * engine.parts.get("weights", 0.0)
            else:
                shared = Usage("colocated GPU (trainer and engine both resident)")
                shared.parts.update({"trainer": trainer.total - CUDA_RESERVE, "engine": engine.total - CUDA_RESERVE,
                                     "CUDA reserve (two processes)": 2 * CUDA_RESERVE})
            gpus.append(shared)
        else:
            gpus += [trainer] + ([engine] if engine.parts else [])
    else:  # a CPU-only machine: every role in host RAM, fp32
        host.parts["trainer ranks"] = ranks_per_node * trainer.total
        host.parts["engines"] = engines_per_node * engine.total
    return MemoryPlan(gpus, host, capacity, _host_capacity(cfg), on_gpu, moves)


# ---- refusal with what would fit ----------------------------------------------------------------------------------
def _over(plan: MemoryPlan) -> list[str]:
    """The places that do not fit: GPU roles (their names) and "host"."""
    out = [] if plan.gpu_capacity is None else [u.role for u in plan.gpu if u.total > plan.gpu_capacity]
    if plan.host_capacity is not None and plan.host.total > plan.host_capacity:
        out.append("host")
    return out


def _try(cfg: SlimeConfig, overrides: dict[str, object]) -> Optional[MemoryPlan]:
    """The plan of cfg with ``overrides`` (dotted keys) applied, or None when that config is not well formed."""
    groups: dict[str, dict] = {}
    top = {}
    for key, value in overrides.items():
        group, _, name = key.partition(".")
        if name:
            groups.setdefault(group, {})[name] = value
        else:
            top[group] = value
    changed = replace(cfg, **top, **{g: replace(getattr(cfg, g), **kv) for g, kv in groups.items()})
    try:
        return plan_memory(changed, derive(changed))
    except (ZeroDivisionError, ValueError):
        return None


def _fixes(cfg: SlimeConfig, d: Derived, place: str) -> list[str]:
    """Overrides that make ``place`` (a GPU role or "host") fit without making anything else overflow, each
    checked by re-planning (cheapest kinds first)."""
    out = []
    candidates: list[dict[str, object]] = []
    if cfg.cluster.colocate and cfg.cluster.colocate_offload == "never":
        candidates.append({"cluster.colocate_offload": "always"})
    if not cfg.train.gradient_checkpointing and cfg.cluster.gpus_per_node > 0:
        candidates.append({"train.gradient_checkpointing": True})
    if cfg.train.micro_batch_samples > 1 and not cfg.train.max_tokens_per_gpu:
        candidates.append({"train.micro_batch_samples": 1})
        if not cfg.train.gradient_checkpointing and cfg.cluster.gpus_per_node > 0:
            candidates.append({"train.gradient_checkpointing": True, "train.micro_batch_samples": 1})
    if ENGINE_KINDS[cfg.rollout.backend].memory == "measured" and cfg.cluster.gpus_per_node > 0:
        concurrency = cfg.rollout.max_concurrency_per_engine // 2  # bounds its decode buffers and KV cache
        while concurrency >= 8:
            candidates.append({"rollout.max_concurrency_per_engine": concurrency})
            concurrency //= 2
    if cfg.cluster.colocate:
        candidates.append({"cluster.colocate": False, "rollout.num_gpus": d.train_gpus})
    for gpus in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if gpus > cfg.train.num_gpus and gpus % cfg.train.model_parallel_size == 0:
            candidates.append({"train.num_gpus": gpus})
    before = set(_over(plan_memory(cfg, d)))
    for candidate in candidates:
        plan = _try(cfg, candidate)
        if plan is not None and place not in _over(plan) and set(_over(plan)) <= before:
            out.append(" ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in candidate.items()))
            if len(out) == 3:
                break
    return out


def memory_problems(cfg: SlimeConfig, d: Derived, plan: MemoryPlan) -> Iterator[Problem]:
    """One problem per place that does not fit: each GPU role, the host."""
    for usage in plan.gpu:
        if plan.gpu_capacity is None or usage.total <= plan.gpu_capacity:
            continue
        fixes = _fixes(cfg, d, usage.role)
        engine = usage.role == "engine"
        keys = (("cluster.gpu_memory_gb", "rollout.max_concurrency_per_engine", "rollout.backend") if engine else
                ("cluster.gpu_memory_gb", "train.num_gpus", "train.micro_batch_samples"))
        if "both resident" in usage.role:
            keys = ("cluster.colocate_offload", *keys)
        fallback = ("serve the model with SGLang's paged cache (rollout=sglang) or use bigger GPUs" if engine else
                    "shard more (train.num_gpus, train=megatron train.tp / train.pp) or use bigger GPUs")
        yield Problem(keys, f"{usage.line()} does not fit a GPU of {plan.gpu_capacity / GiB:.0f} GiB; the smallest "
                      f"GPU that holds it has {math.ceil(usage.total / GiB)} GiB",
                      ("try " + "; or ".join(fixes)) if fixes else fallback)
    if plan.host_capacity is not None and plan.host.total > plan.host_capacity:
        need = math.ceil(plan.host.total / GiB)
        if not plan.on_gpu:
            params = param_counts(cfg).total(cfg.model.num_layers)
            yield Problem(("cluster.gpus_per_node", "model"),
                          f"on this CPU-only machine the run needs ~{need} GiB of host RAM ({plan.host.line()}), "
                          f"{plan.host_capacity / GiB:.0f} GiB here: {cfg.model.name} has {params / 1e9:.1f}B "
                          "parameters",
                          "train it on GPUs: cluster=<a GPU site, e.g. slurm_8xh100> (or cluster.gpus_per_node=N "
                          "cluster.gpu_memory_gb=M on a GPU machine) and model.path=<checkpoint>")
        else:
            yield Problem(("cluster.mem_gb",),
                          f"a node needs ~{need} GiB of host RAM ({plan.host.line()}), "
                          f"{plan.host_capacity / GiB:.0f} GiB available",
                          f"set cluster.mem_gb >= {need} (a larger node), or reduce what lives on the host "
                          "(algo.kl_loss_coef=0 drops the reference copies; cluster.colocate=false the offload; "
                          "checkpoint_in_background=false the checkpoint copy)")
