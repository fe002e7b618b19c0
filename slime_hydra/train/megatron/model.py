"""The architecture of an HF checkpoint as megatron-core sees it, and the GPTModel built from it.

``Arch`` holds what both the model builder and the weight converter need: the numbers of ``ModelConfig`` plus the
family's structural facts (QKV bias, q/k norm, GLM-4's sandwich norms, interleaved or half-split RoPE, fused
gate/up) and HF's own RoPE inverse frequencies, so any rope_type transformers implements (default, llama3, linear,
dynamic at its base length ...) is reproduced exactly.

Families and what Megatron expresses them with:
    qwen2  Qwen2/Qwen2.5: bias on q/k/v only (add_qkv_bias)
    qwen3  Qwen3 dense: RMSNorm on q and k per head (qk_layernorm), no biases
    llama  Llama 3: no biases; llama3 rope scaling via HF's inverse frequencies
    glm4   GLM-4-0414: q/k/v bias, fused gate_up_proj, partial (head_dim/2) interleaved RoPE, and RMSNorms on the
           attention and MLP outputs before each residual add (spec.PostNormBiasDropoutAdd)
    qwen3_moe  Qwen3-MoE: qwen3's attention; the MLP of every sparse layer is megatron-core's own MoELayer
           (TopKRouter with softmax scores over num_experts, top-k = num_experts_per_tok, HF's norm_topk_prob as
           megatron's moe_router_pre_softmax=False; experts as SequentialMLP, or TEGroupedMLP's grouped GEMM with
           TransformerEngine on a GPU; no shared experts); layers listed in mlp_only_layers or off the
           decoder_sparse_step keep a dense MLP (intermediate_size). Tokens reach the experts through megatron's
           allgather dispatcher (moe.py).
    glm4_moe  GLM-4.5 (GLM-4.5-Air): q/k/v bias, q/k norm when use_qk_norm, partial (half-split) RoPE; MoE layers
           with DeepSeek's router (see grouped_router below) after first_k_dense_replace dense layers.
    deepseek_v3  DeepSeek-V3: multi-latent attention through megatron-core's MLASelfAttention and
           MLATransformerConfig (mla.py: q_lora_rank, or None for queries projected directly; kv_lora_rank;
           qk_nope_head_dim -> qk_head_dim, qk_rope_head_dim -> qk_pos_emb_head_dim, v_head_dim; the softmax scale
           1 / sqrt(qk_head_dim) times yarn's mscale(factor, mscale_all_dim)^2 through rotary_scaling_factor and
           mscale_all_dim; RoPE from transformers' inverse frequencies and attention factor, so yarn is
           transformers' own; rope_interleave=True is megatron's MLA layout, False is permuted by convert.py); the
           grouped router's MoE layers after first_k_dense_replace dense ones.

The grouped router (glm4_moe) is megatron's TopKRouter with moe_router_score_function="sigmoid": the expert choice
ranks sigmoid(logit) + HF's e_score_correction_bias (megatron's expert_bias, enabled with
moe_router_enable_expert_bias and frozen: moe_router_bias_update_rate=0, and this backend never calls megatron's
bias update; transformers holds it as a buffer, so RL does not move it), group-limited top-k
(moe_router_num_groups / moe_router_group_topk = n_group / topk_group; a group scores its top topk / topk_group
experts in megatron, its top 2 in transformers, so the two agree when that quotient is 2 or every group is chosen),
the chosen sigmoid scores renormalised (norm_topk_prob; megatron always renormalises k > 1 sigmoid scores) and
multiplied by routed_scaling_factor (moe_router_topk_scaling_factor); router logits in fp32 as in transformers
(moe_router_dtype); shared experts (megatron's SharedExpertMLP, moe_shared_expert_intermediate_size =
n_shared_experts x moe_intermediate_size) added to the routed output; the first first_k_dense_replace layers keep a
dense MLP of intermediate_size.
"""

import dataclasses
import importlib
import importlib.util
import typing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.families import FAMILIES


@dataclass(frozen=True)
class Arch:
    """ModelConfig's numbers (read from the checkpoint's config.json, the source of truth for the weights) plus
    the family's structure. Built by ``from_hf`` (or ``from_model_config`` for the random-init families)."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    sandwich_norm: bool
    fused_gate_up: bool
    rotary_interleaved: bool
    attention_dropout: float
    inv_freq: torch.Tensor = field(compare=False, repr=False)
    """[rotary_dim / 2] RoPE inverse frequencies exactly as transformers computes them (rotary_dim <= head_dim)."""
    num_experts: int = 0
    """Routed experts per sparse layer (0: a dense model)."""
    moe_top_k: int = 0
    """Experts each token is sent to (HF num_experts_per_tok)."""
    moe_ffn_hidden_size: int = 0
    """One expert's intermediate size (HF moe_intermediate_size)."""
    moe_norm_topk: bool = False
    """The top-k probabilities are renormalised to sum to 1 (HF norm_topk_prob)."""
    moe_layers: tuple[int, ...] = ()
    """0-based layer numbers whose MLP is the MoE layer; the others are dense."""
    moe_aux_loss_coeff: float = 0.0
    """Megatron's switch load-balancing loss per MoE layer (``moe_aux_loss_coeff``); 0 (default) trains without it,
    as transformers does unless output_router_logits is set and labels are given (train=fsdp never passes labels)."""
    moe_score: str = "softmax"
    """The router's score function: softmax (Qwen3-MoE) or sigmoid (the grouped router)."""
    moe_expert_bias: bool = False
    """A fixed per-expert bias added to the scores that choose the experts (HF e_score_correction_bias)."""
    moe_groups: int = 1
    """Expert groups of group-limited routing (HF n_group; 1: none)."""
    moe_group_top_k: int = 1
    """Groups a token may route to (HF topk_group)."""
    moe_scaling: float = 1.0
    """Factor on the routed experts' weights (HF routed_scaling_factor)."""
    moe_shared_ffn_hidden_size: int = 0
    """The shared experts' total intermediate width (HF n_shared_experts x moe_intermediate_size; 0: none)."""
    q_lora_rank: int = 0
    """Multi-latent attention: the query latent's width (HF q_lora_rank; 0: queries projected directly)."""
    kv_lora_rank: int = 0
    """Multi-latent attention: the key/value latent's width (HF kv_lora_rank; 0: not multi-latent attention)."""
    qk_nope_head_dim: int = 0
    """Multi-latent attention: a query/key head's channels without RoPE."""
    qk_rope_head_dim: int = 0
    """Multi-latent attention: a query/key head's channels with RoPE (the key's shared by every head)."""
    v_head_dim: int = 0
    """Multi-latent attention: a value head's width."""
    rope_interleave: bool = True
    """Multi-latent attention: the checkpoint's rotary channels rotate in pairs (x0, x1), (x2, x3) ... (HF
    rope_interleave: megatron's MLA layout); False: (x_i, x_{i + d/2}), permuted by convert.py."""
    rope_scaling_factor: float = 1.0
    """Multi-latent attention: the rope scaling factor of the softmax's yarn mscale (1: none)."""
    mscale_all_dim: float = 0.0
    """Multi-latent attention: yarn's mscale_all_dim of the softmax scale (0: none)."""
    rope_attention_scaling: float = 1.0
    """Multi-latent attention: transformers' attention factor on cos and sin (yarn's; 1 otherwise)."""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @classmethod
    def from_hf(cls, config, moe_aux_loss_coeff: float = 0.0) -> "Arch":
        """The architecture of a transformers config; refuses what megatron-core's GPT layer cannot express.
        ``moe_aux_loss_coeff``: the router's load-balancing loss coefficient (MoE families; 0 = off)."""
        family_name = config.model_type
        family = FAMILIES.get(family_name)
        if family is None or "megatron" not in family.backends:
            raise ValueError(f"model_type={family_name!r}: train=megatron converts "
                             f"{sorted(n for n, f in FAMILIES.items() if 'megatron' in f.backends)}")
        problems = []
        if getattr(config, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={config.hidden_act} (SwiGLU needs silu)")
        if getattr(config, "mlp_bias", False):
            problems.append("mlp_bias=True")
        if getattr(config, "use_sliding_window", False):
            problems.append("use_sliding_window=True")
        attention_bias = bool(getattr(config, "attention_bias", False))
        if family.qkv_bias == "o_too" and attention_bias:
            problems.append("attention_bias=True (puts a bias on o_proj too; megatron would bias the MLP as well)")
        rotary_cls = _import(family.rotary_class)
        rotary = rotary_cls(config)
        if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0 and not family.latent_attention:
            problems.append(f"rope with attention scaling {rotary.attention_scaling} (e.g. yarn)")
        if family.latent_attention:
            problems += _latent_problems(config)
        if family.moe and not family.grouped_router and getattr(config, "shared_expert_intermediate_size", 0):
            problems.append("shared experts (Qwen3-MoE has none)")
        if family.grouped_router:
            problems += _grouped_router_problems(config)
        if problems:
            raise ValueError(f"{family_name} checkpoint not expressible by train=megatron: " + "; ".join(problems))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        moe = _moe_fields(config, moe_aux_loss_coeff, family.grouped_router) if family.moe else {}
        latent = _latent_fields(config, rotary) if family.latent_attention else {}
        head_dim = latent.pop("head_dim", head_dim)
        return cls(
            family=family_name, num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(config.tie_word_embeddings), norm_eps=float(config.rms_norm_eps),
            qkv_bias=family.qkv_bias == "always" or (family.qkv_bias == "config" and attention_bias),
            qk_norm=family.qk_norm or bool(getattr(config, "use_qk_norm", False)), sandwich_norm=family.sandwich_norm,
            fused_gate_up=family.fused_gate_up,
            rotary_interleaved=family.rotary_interleaved,
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            inv_freq=rotary.inv_freq.detach().float().cpu().clone(), **moe, **latent,
        )

    @classmethod
    def from_model_config(cls, model: ModelConfig) -> "Arch":
        from slime_hydra.model.hf import hf_config

        return cls.from_hf(hf_config(model))


def _moe_fields(config, aux_loss_coeff: float, grouped: bool) -> dict[str, Any]:
    """Arch's MoE fields from a Qwen3-MoE config (layer i is sparse when it is not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0, transformers' rule) or a grouped-router one (layers from
    first_k_dense_replace on are sparse)."""
    if aux_loss_coeff < 0:
        raise ValueError(f"moe_aux_loss_coeff={aux_loss_coeff} must be >= 0")
    common = dict(moe_top_k=int(config.num_experts_per_tok), moe_ffn_hidden_size=int(config.moe_intermediate_size),
                  moe_norm_topk=bool(getattr(config, "norm_topk_prob", False)),
                  moe_aux_loss_coeff=float(aux_loss_coeff))
    if grouped:
        experts = int(config.n_routed_experts)
        return dict(common, num_experts=experts, moe_score="sigmoid", moe_expert_bias=True,
                    moe_layers=tuple(range(int(config.first_k_dense_replace or 0), config.num_hidden_layers)),
                    moe_groups=int(config.n_group or 1), moe_group_top_k=int(config.topk_group or 1),
                    moe_scaling=float(config.routed_scaling_factor),
                    moe_shared_ffn_hidden_size=int(config.n_shared_experts or 0) * int(config.moe_intermediate_size))
    experts = int(config.num_experts)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(config.num_hidden_layers)
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(common, num_experts=experts, moe_layers=layers)


def _latent_fields(config, rotary) -> dict[str, Any]:
    """Arch's multi-latent attention fields from a DeepSeek-V3 config. The softmax scale's yarn mscale is transformers'
    (yarn_apply_mscale: any rope_type but default with mscale_all_dim); head_dim is a query/key head's width."""
    rope = dict(config.rope_parameters or {})
    scaled = rope.get("rope_type", "default") != "default"
    return dict(q_lora_rank=int(config.q_lora_rank or 0), kv_lora_rank=int(config.kv_lora_rank),
                qk_nope_head_dim=int(config.qk_nope_head_dim), qk_rope_head_dim=int(config.qk_rope_head_dim),
                v_head_dim=int(config.v_head_dim), rope_interleave=bool(getattr(config, "rope_interleave", True)),
                rope_scaling_factor=float(rope.get("factor") or 1.0) if scaled else 1.0,
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0) if scaled else 0.0,
                rope_attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
                head_dim=int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim))


def _latent_problems(config) -> list[str]:
    """What megatron's MLA layer cannot express of transformers' DeepseekV3Attention."""
    out = []
    if getattr(config, "attention_bias", False):
        out.append("attention_bias=True (biases on q_a_proj, kv_a_proj_with_mqa and o_proj)")
    if config.num_key_value_heads != config.num_attention_heads:
        out.append(f"num_key_value_heads={config.num_key_value_heads} != num_attention_heads="
                   f"{config.num_attention_heads} (multi-latent attention expands keys to every head)")
    return out


def _grouped_router_problems(config) -> list[str]:
    """What megatron's TopKRouter cannot express of transformers' grouped sigmoid router (module docstring)."""
    out = []
    top_k, groups, chosen = int(config.num_experts_per_tok), int(config.n_group or 1), int(config.topk_group or 1)
    if not getattr(config, "norm_topk_prob", False):
        out.append("norm_topk_prob=False (megatron renormalises the chosen sigmoid scores)")
    elif top_k == 1:
        out.append("num_experts_per_tok=1 with norm_topk_prob (megatron keeps a single expert's raw sigmoid score)")
    if chosen < groups and top_k // chosen != 2:
        out.append(f"n_group={groups} with topk_group={chosen} and num_experts_per_tok={top_k}: megatron scores a "
                   f"group by its best num_experts_per_tok // topk_group = {top_k // chosen} experts, transformers by "
                   "its best 2")
    return out


def _import(dotted: str):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def transformer_engine_available() -> bool:
    """TransformerEngine's layer spec is used when it imports and the model lives on a GPU."""
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def init_parallel(tp: int, pp: int = 1, cp: int = 1, ep: int = 1, seed: int = 0) -> None:
    """Megatron's process groups over the already-initialised default group (its rank order "tp-cp-ep-dp-pp": TP
    fastest, then CP, DP, PP slowest), and its RNG tracker. The experts' grid is "tp-ep-dp-pp" without CP: in stage
    s (ranks from o = s * tp * cp * dp), TP rank t with DP x CP index i = cp_rank + cp * dp_rank is EP rank i mod ep
    of the EP group {o + t + tp * (k + ep * (i // ep)) : k < ep}, so EP peers are DP or CP peers of one stage, and
    its expert-DP group holds the stage's ranks of the same t and EP rank. On CPU the tracker is the inference one
    (no CUDA RNG states; valid because dropout is 0). Experts are split over TP like dense MLPs (expert TP = tp)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, cp, ep):
            raise RuntimeError(f"megatron parallel state already initialised with tp, pp, cp, ep = {have}, asked "
                               f"{(tp, pp, cp, ep)}")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep,
                                             create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())


def config_schema(mla: bool):
    """megatron-core's config class the backend builds: MLATransformerConfig for multi-latent attention."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if mla else TransformerConfig


def config_field_types(mla: bool) -> dict[str, Any]:
    """Field name -> type hint of ``config_schema(mla)``: the domain of the train.megatron passthrough (what
    ``transformer_config`` accepts as overrides; config/passthrough.py checks a config against it)."""
    schema = config_schema(mla)
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema) if f.init}


def transformer_config(arch: Arch, tp: int = 1, pp: int = 1, cp: int = 1, device: str = "cpu",
                       use_te: bool = False, overrides: dict[str, Any] | None = None, ep: int = 1):
    """megatron's TransformerConfig for this architecture. Parameters are fp32 (the optimizer's masters); bf16
    compute runs on precision.ComputeCopy's bf16 copies of them (backend.py). ``overrides`` are TransformerConfig
    fields (train.megatron passthrough).

    MoE (arch.is_moe): softmax router scores; norm_topk_prob=True is megatron's moe_router_pre_softmax=False (top-k
    of the logits, softmax over those k: the renormalised probabilities), False is pre-softmax (softmax over all
    experts, then top-k); the grouped router's sigmoid options (module docstring); the allgather token dispatcher
    (moe.py says why); grouped GEMM with TransformerEngine only; the load-balancing loss only when
    arch.moe_aux_loss_coeff > 0."""
    use_te = use_te and not arch.is_mla  # build_model's spec: MLA runs the local spec (mla.py)
    kwargs = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads, kv_channels=arch.v_head_dim if arch.is_mla else arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        rotary_interleaved=arch.rotary_interleaved, hidden_dropout=0.0, attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=device == "cpu",
        perform_initialization=False,
        transformer_impl="transformer_engine" if use_te else "local",
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size, moe_router_score_function="softmax",
            moe_router_pre_softmax=not arch.moe_norm_topk, moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=use_te, expert_model_parallel_size=ep, moe_permute_fusion=False,
            moe_router_load_balancing_type="aux_loss" if arch.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
        )
    if arch.is_moe and arch.moe_score == "sigmoid":  # the grouped router (module docstring)
        grouped = arch.moe_group_top_k < arch.moe_groups
        kwargs.update(
            moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_dtype="fp32",
            moe_router_enable_expert_bias=arch.moe_expert_bias, moe_router_bias_update_rate=0.0,
            moe_router_num_groups=arch.moe_groups if grouped else None,
            moe_router_group_topk=arch.moe_group_top_k if grouped else None,
            moe_router_topk_scaling_factor=arch.moe_scaling,
            moe_shared_expert_intermediate_size=arch.moe_shared_ffn_hidden_size or None,
        )
    if arch.is_mla:  # mla.py applies transformers' RoPE itself: rope_type "rope" keeps megatron's yarn module out
        kwargs.update(
            q_lora_rank=arch.q_lora_rank or None, kv_lora_rank=arch.kv_lora_rank, qk_head_dim=arch.qk_nope_head_dim,
            qk_pos_emb_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim, rope_type="rope",
            rotary_scaling_factor=arch.rope_scaling_factor, mscale_all_dim=arch.mscale_all_dim,
        )
    schema = config_schema(arch.is_mla)
    unknown = sorted(set(overrides or {}) - set(config_field_types(arch.is_mla)))
    if unknown:
        raise ValueError(f"train.megatron options {unknown} are not megatron-core {schema.__name__} fields; "
                         "the megatron backend passes only those through")
    kwargs.update(overrides or {})
    return schema(**kwargs)


def build_model(arch: Arch, config, use_te: bool = False, device: str | torch.device = "cpu", head: str = "lm"):
    """This pipeline stage's GPTModel on ``device`` with HF-exact RoPE. Weights are uninitialised: load them with
    convert.load_hf_weights.

    head="lm": the vocab-parallel output layer (tied to the embedding when the checkpoint ties them).
    head="value": the PPO critic, ``ValueHead`` in the output layer's slot (HF's *ForTokenClassification "score").

    Stages: the first holds the embedding, the last the final norm and the head, each its share of the layers
    (megatron's own split; layer numbers stay global). With pp > 1 and tied embeddings the last stage holds a copy
    of the embedding as its output layer; megatron would make the copies equal with an all-reduce that moves the
    weight to CUDA, so the model gets no embedding group (``embd=None``) and the backend loads the copy from the
    checkpoint and sums the two copies' gradients itself."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from slime_hydra.train.megatron.spec import HFRotaryEmbedding, ValueHead, block_spec, layer_spec

    tp = config.tensor_model_parallel_size
    if head == "lm" and arch.vocab_size % tp:
        raise ValueError(f"vocab_size={arch.vocab_size} is not divisible by train.tp={tp} (the vocabulary is split "
                         "evenly across TP ranks)")
    use_te = use_te and not arch.is_mla
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.embd = None
    post_process = parallel_state.is_pipeline_last_stage()
    layer = layer_spec
    if arch.is_mla:  # each MLA layer applies RoPE itself (mla.py); GPTModel builds none
        from slime_hydra.train.megatron.mla import LatentRotary, latent_layer_spec

        layer = partial(latent_layer_spec, rotary=LatentRotary(arch.inv_freq.to(device), arch.rope_attention_scaling,
                                                               cp_group=groups.cp))
    model = GPTModel(config=config, transformer_layer_spec=block_spec(arch, config, use_te, layer),
                     vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(), post_process=post_process,
                     parallel_output=True, share_embeddings_and_output_weights=arch.tie_word_embeddings and head == "lm",
                     position_embedding_type="rope", pg_collection=groups)
    if head == "value" and post_process:
        model.output_layer = ValueHead(arch.hidden_size)
    model.to(device)  # linears are allocated on the GPU already; torch's norms are built on the host
    if not arch.is_mla:
        model.rotary_pos_emb = HFRotaryEmbedding(arch.inv_freq.to(device), arch.rotary_interleaved,
                                                 cp_group=groups.cp)
    return model
