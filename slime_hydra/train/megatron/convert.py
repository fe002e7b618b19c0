"""HF <-> Megatron weights, with tensor-parallel sharding.

One table (``param_map``) pairs every megatron parameter with the HF tensors it is made of and how it is split
across TP ranks; loading shards HF tensors into this rank's parameters, exporting all-gathers the shards over the
TP group and splits them back into HF tensors.

    kind        megatron parameter on TP rank r of t                        HF tensors
    replicated  the HF tensor (norms)                                       one
    vocab       rows [r V/t, (r+1) V/t) (embedding, output layer)           one [V, H]
    row         columns r of t (o_proj, down_proj: row-parallel linears)    one [H, X]
    qkv         per query group g: [q heads of g; k_g; v_g], concatenated   q, k, v (weights [X, H] or biases [X])
                over groups, then rows r of t (megatron's interleaving)
    gate_up     [gate rows r of t; up rows r of t] (SwiGLU fc1)             gate, up; GLM-4: one fused [gate; up]
    column      rows r of t (multi-latent attention's column-parallel       one [X, Y]
                projections: q_a_proj, kv_b_proj)
    latent_q    rows r of t (whole heads of q_b_proj, or q_proj)            one [heads (nope + rope), Y]
    latent_kv   rows r of t (kv_a_proj_with_mqa: latent, then rope rows)    one [kv_lora + rope, H]
                (latent_q / latent_kv: a rope_interleave=False checkpoint's rotary rows interleaved, ``_rope_rows``)

With fewer query groups than TP ranks megatron still splits the interleaved QKV rows evenly (and all-gathers the
projection), which the same rule covers. TransformerEngine's spec fuses the pre-attention and pre-MLP norms into
the next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the table follows it.

Pipeline parallelism: the table uses global layer numbers (``decoder.layers.{i}``, as at PP=1); a stage's module
numbers its layers from 0, so ``stage_parameters`` renames them by each layer's global ``layer_number``. A stage
loads only the table rows it holds; export gathers a parameter over TP on the stage holding it and broadcasts the
HF tensors over the PP group, so every rank sees every HF tensor.

The PPO critic (head="value") has HF *ForTokenClassification names: the same trunk and ``score.{weight, bias}``
(megatron ``output_layer.{weight, bias}``, replicated), no lm_head.

MoE layers (HF checkpoint names, one tensor per expert as the safetensors files store them):

    megatron (decoder.layers.{i}.mlp.)               kind        HF (model.layers.{i}.mlp.)
    router.weight [E, H]                             replicated  gate.weight
    router.expert_bias [E] (a buffer)                replicated  gate.e_score_correction_bias (grouped router)
    experts.local_experts.{e}.linear_fc1.weight      gate_up     experts.{e}.gate_proj.weight, .up_proj.weight
    experts.local_experts.{e}.linear_fc2.weight      row         experts.{e}.down_proj.weight
    shared_experts.linear_fc1.weight                 gate_up     shared_experts.gate_proj.weight, .up_proj.weight
    shared_experts.linear_fc2.weight                 row         shared_experts.down_proj.weight
    (TransformerEngine's grouped experts: experts.linear_fc1.weight{e}, experts.linear_fc2.weight{e})

The router's expert bias is a buffer in both (transformers' e_score_correction_bias, megatron's expert_bias): it is
loaded, exported and synced like a parameter but never trained (``stage_tensors``).

Multi-latent attention (DeepSeek-V3; mla.py), in place of linear_qkv:

    megatron (decoder.layers.{i}.self_attention.)    kind        HF (model.layers.{i}.self_attn.)
    linear_q_down_proj.weight [q_lora, H]             column      q_a_proj.weight
    q_layernorm.weight                                replicated  q_a_layernorm.weight
    linear_q_up_proj.weight [h (nope + rope), q_lora] latent_q    q_b_proj.weight (q_proj.weight without q_lora_rank)
    linear_kv_down_proj.weight [kv_lora + rope, H]    latent_kv   kv_a_proj_with_mqa.weight
    kv_layernorm.weight                               replicated  kv_a_layernorm.weight
    linear_kv_up_proj.weight [h (nope + v), kv_lora]  column      kv_b_proj.weight
    linear_proj.weight                                row         o_proj.weight

The table numbers experts globally, as it numbers layers; under expert parallelism EP rank k holds experts
[k E / ep, (k + 1) E / ep) as its local experts 0 .. E / ep - 1 (megatron's split), ``stage_parameters`` renames
them by the layer's ``local_expert_indices``, so a rank loads only its own experts. Export gathers an expert over
TP on the EP rank holding it and broadcasts it over its stage's EP group (then over PP, like any tensor). Experts
are TP-split like a dense MLP (the gate_up and row rules). transformers (5.x) holds a layer's experts as two
stacked tensors, ``experts.gate_up_proj`` [E, 2F, H] (gate rows, then up rows) and ``experts.down_proj``
[E, H, F]; ``transformers_names`` turns the checkpoint's per-expert tensors into those (what train=fsdp's weights
are named, and what export_hf's save_pretrained turns back into per-expert tensors on disk).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open

from slime_hydra.train.megatron.model import Arch


@dataclass(frozen=True)
class Param:
    megatron: str
    """Parameter name in megatron's GPTModel."""
    hf: tuple[str, ...]
    """HF state-dict names it is made of."""
    kind: str
    """replicated | vocab | column | latent_q | latent_kv | row | qkv | gate_up (see the module docstring)."""
    expert: int | None = None
    """The global expert number of an MoE expert's parameter (its EP owner: expert // (E / ep))."""


def param_map(arch: Arch, te: bool = False, for_export: bool = False, head: str = "lm") -> list[Param]:
    """Every megatron parameter and its HF source, in HF state-dict order (global layer numbers).

    for_export adds ``lm_head.weight`` from the embedding when tied: HF state dicts list both names.
    head="value": the critic's ``score`` head in place of the LM head."""
    out = [Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn, mlp = h + "self_attn.", h + "mlp."
        qkv = tuple(f"{attn}{x}_proj.weight" for x in "qkv")
        out.append(Param(m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
                         (h + "input_layernorm.weight",), "replicated"))
        if arch.is_mla:
            out.extend(_latent_params(arch, m + "self_attention.", attn))
        else:
            out.append(Param(m + "self_attention.linear_qkv.weight", qkv, "qkv"))
        if arch.qkv_bias:
            out.append(Param(m + "self_attention.linear_qkv.bias", tuple(n[:-6] + "bias" for n in qkv), "qkv"))
        if arch.qk_norm:
            out.append(Param(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
            out.append(Param(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
        out.append(Param(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"))
        if arch.sandwich_norm:
            out.append(Param(m + "self_attn_bda.norm.weight", (h + "post_self_attn_layernorm.weight",), "replicated"))
        moe = i in arch.moe_layers
        out.append(Param(m + ("mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"),
                         (h + "post_attention_layernorm.weight",), "replicated"))
        if moe:
            out.extend(_moe_params(arch, m + "mlp.", mlp, te))
        else:
            gate_up = (mlp + "gate_up_proj.weight",) if arch.fused_gate_up else (mlp + "gate_proj.weight",
                                                                                  mlp + "up_proj.weight")
            out.append(Param(m + "mlp.linear_fc1.weight", gate_up, "gate_up"))
            out.append(Param(m + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "row"))
        if arch.sandwich_norm:
            out.append(Param(m + "mlp_bda.norm.weight", (h + "post_mlp_layernorm.weight",), "replicated"))
    out.append(Param("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if head == "value":
        out.append(Param("output_layer.weight", ("score.weight",), "replicated"))
        out.append(Param("output_layer.bias", ("score.bias",), "replicated"))
    elif not arch.tie_word_embeddings:
        out.append(Param("output_layer.weight", ("lm_head.weight",), "vocab"))
    elif for_export:
        out.append(Param("embedding.word_embeddings.weight", ("lm_head.weight",), "vocab"))
    return out


def _latent_params(arch: Arch, m: str, h: str) -> list[Param]:
    """One multi-latent attention's rows but its output projection (mla.py), in transformers' order."""
    out = []
    if arch.q_lora_rank:
        out.append(Param(m + "linear_q_down_proj.weight", (h + "q_a_proj.weight",), "column"))
        out.append(Param(m + "q_layernorm.weight", (h + "q_a_layernorm.weight",), "replicated"))
        out.append(Param(m + "linear_q_up_proj.weight", (h + "q_b_proj.weight",), "latent_q"))
    else:
        out.append(Param(m + "linear_q_proj.weight", (h + "q_proj.weight",), "latent_q"))
    out.append(Param(m + "linear_kv_down_proj.weight", (h + "kv_a_proj_with_mqa.weight",), "latent_kv"))
    out.append(Param(m + "kv_layernorm.weight", (h + "kv_a_layernorm.weight",), "replicated"))
    out.append(Param(m + "linear_kv_up_proj.weight", (h + "kv_b_proj.weight",), "column"))
    return out


def _rope_rows(t: torch.Tensor, arch: Arch, per_head: bool, to_megatron: bool) -> torch.Tensor:
    """The rotary rows of a latent_q (per head: the last qk_rope_head_dim of each head's rows) or latent_kv (the
    last qk_rope_head_dim rows) weight in the other side's layout. megatron's MLA de-interleaves the rotary channels
    (x0, x2, ..., x1, x3, ...) before rotating halves, which is transformers' rope_interleave=True; a
    rope_interleave=False checkpoint rotates halves as stored, so its rows are interleaved for megatron (and
    de-interleaved back)."""
    if arch.rope_interleave:
        return t
    r = arch.qk_rope_head_dim
    rows = t.reshape(arch.num_attention_heads, -1, *t.shape[1:]) if per_head else t.unsqueeze(0)
    rope = rows[:, -r:]
    if to_megatron:
        rope = torch.stack((rope[:, :r // 2], rope[:, r // 2:]), dim=2).flatten(1, 2)
    else:
        rope = torch.cat((rope[:, 0::2], rope[:, 1::2]), dim=1)
    return torch.cat((rows[:, :-r], rope), dim=1).reshape(t.shape)


def _moe_params(arch: Arch, m: str, h: str, te: bool) -> list[Param]:
    """One MoE layer's rows: the router, then each expert's fc1 and fc2 (global expert numbers)."""
    out = [Param(m + "router.weight", (h + "gate.weight",), "replicated")]
    if arch.moe_expert_bias:
        out.append(Param(m + "router.expert_bias", (h + "gate.e_score_correction_bias",), "replicated"))
    for e in range(arch.num_experts):
        fc1, fc2 = ((f"experts.linear_fc1.weight{e}", f"experts.linear_fc2.weight{e}") if te else
                    (f"experts.local_experts.{e}.linear_fc1.weight", f"experts.local_experts.{e}.linear_fc2.weight"))
        expert = f"{h}experts.{e}."
        out.append(Param(m + fc1, (expert + "gate_proj.weight", expert + "up_proj.weight"), "gate_up", e))
        out.append(Param(m + fc2, (expert + "down_proj.weight",), "row", e))
    if arch.moe_shared_ffn_hidden_size:
        shared = h + "shared_experts."
        out.append(Param(m + "shared_experts.linear_fc1.weight", (shared + "gate_proj.weight",
                                                                   shared + "up_proj.weight"), "gate_up"))
        out.append(Param(m + "shared_experts.linear_fc2.weight", (shared + "down_proj.weight",), "row"))
    return out


def transformers_names(weights: Iterator[tuple[str, torch.Tensor]], arch: Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) under transformers' in-memory names: a layer's per-expert checkpoint tensors (which arrive
    together, in expert order) become its stacked ``experts.gate_up_proj`` [E, 2F, H] and ``experts.down_proj``
    [E, H, F]; every other tensor passes through."""
    if not arch.is_moe:
        yield from weights
        return
    pending: dict[str, list[torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, dot, rest = name.partition(".experts.")
        if not dot or not prefix.startswith("model.layers."):
            yield name, tensor
            continue
        expert, _, which = rest.partition(".")
        pending.setdefault(which, []).append(tensor)
        if int(expert) == arch.num_experts - 1 and which == "down_proj.weight":
            gate, up, down = (pending.pop(k) for k in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
            yield prefix + ".experts.gate_up_proj", torch.stack([torch.cat(gu) for gu in zip(gate, up)])
            yield prefix + ".experts.down_proj", torch.stack(down)


# ---- one tensor: HF -> this rank's shard, all ranks' shards -> HF ---------------------------------------------
def shard(p: Param, hf: list[torch.Tensor], arch: Arch, rank: int, size: int) -> torch.Tensor:
    """This TP rank's megatron tensor made from the HF tensors of ``p``."""
    if p.kind == "replicated":
        return hf[0]
    if p.kind in ("vocab", "column"):
        return hf[0].chunk(size, dim=0)[rank]
    if p.kind in ("latent_q", "latent_kv"):
        return _rope_rows(hf[0], arch, p.kind == "latent_q", to_megatron=True).chunk(size, dim=0)[rank]
    if p.kind == "row":
        return hf[0].chunk(size, dim=1)[rank]
    if p.kind == "qkv":
        q, k, v = hf
        g, rest = arch.num_kv_heads, q.shape[1:]
        grouped = torch.cat([q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest)], dim=1)
        return grouped.reshape(-1, *rest).chunk(size, dim=0)[rank]
    if p.kind == "gate_up":
        gate, up = hf if len(hf) == 2 else hf[0].chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise ValueError(f"unknown kind {p.kind!r}")


def unshard(p: Param, shards: list[torch.Tensor], arch: Arch) -> list[torch.Tensor]:
    """The HF tensors of ``p`` from every TP rank's megatron tensor (rank order)."""
    if p.kind == "replicated":
        return [shards[0]]
    if p.kind in ("vocab", "column"):
        return [torch.cat(shards, dim=0)]
    if p.kind in ("latent_q", "latent_kv"):
        return [_rope_rows(torch.cat(shards, dim=0), arch, p.kind == "latent_q", to_megatron=False)]
    if p.kind == "row":
        return [torch.cat(shards, dim=1)]
    if p.kind == "qkv":
        full = torch.cat(shards, dim=0)
        g, d, rest = arch.num_kv_heads, arch.head_dim, full.shape[1:]
        q, k, v = full.reshape(g, -1, *rest).split([arch.heads_per_group * d, d, d], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    if p.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate, up = torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)
        return [torch.cat([gate, up], dim=0)] if len(p.hf) == 1 else [gate, up]
    raise ValueError(f"unknown kind {p.kind!r}")


def hf_to_megatron(hf_state: dict[str, torch.Tensor], arch: Arch, rank: int, size: int,
                   te: bool = False) -> dict[str, torch.Tensor]:
    """This TP rank's megatron state dict from a full HF state dict."""
    return {p.megatron: shard(p, [hf_state[n] for n in p.hf], arch, rank, size) for p in param_map(arch, te)}


def megatron_to_hf(per_rank: list[dict[str, torch.Tensor]], arch: Arch, te: bool = False) -> dict[str, torch.Tensor]:
    """The full HF state dict (incl. a tied lm_head) from every TP rank's megatron state dict."""
    out = {}
    for p in param_map(arch, te, for_export=True):
        out.update(zip(p.hf, unshard(p, [sd[p.megatron] for sd in per_rank], arch)))
    return out


# ---- a live model ----------------------------------------------------------------------------------------------
TIED_COPY = Param("output_layer.weight", ("model.embed_tokens.weight",), "vocab")
"""The last stage's copy of a tied embedding when pp > 1 (model.build_model)."""


def _uses_te(model) -> bool:
    return model.config.transformer_impl == "transformer_engine"


def stage_parameters(model) -> dict[str, torch.nn.Parameter]:
    """This pipeline stage's parameters under their global (PP=1, EP=1) names: ``decoder.layers.{j}`` of the stage
    is layer ``layer_number - 1`` of the model, and local expert k of an MoE layer is expert
    ``local_expert_indices[k]``."""
    out = {}
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            layer = model.decoder.layers[int(local)]
            name = f"decoder.layers.{layer.layer_number - 1}.{_global_expert(rest, layer.mlp)}"
        out[name] = param
    return out


ROUTER_BUFFER = "mlp.router.expert_bias"
"""The one megatron buffer with an HF counterpart (the grouped router's score correction)."""


def stage_tensors(model) -> dict[str, torch.Tensor]:
    """``stage_parameters`` plus the router buffers that hold checkpoint tensors (``ROUTER_BUFFER``), under the same
    global names: what the conversion table covers."""
    out = stage_parameters(model)
    for name, buffer in model.named_buffers():
        if name.startswith("decoder.layers.") and name.endswith(ROUTER_BUFFER):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            out[f"decoder.layers.{model.decoder.layers[int(local)].layer_number - 1}.{rest}"] = buffer
    return out


def _global_expert(rest: str, mlp) -> str:
    """A layer-relative parameter name with its local expert number replaced by the global one."""
    indices = getattr(mlp, "local_expert_indices", None)
    if indices is None:
        return rest
    head, dot, tail = rest.partition("mlp.experts.local_experts.")
    if dot:  # SequentialMLP: local_experts.{k}.linear_fc1.weight
        k, _, tail = tail.partition(".")
        return f"{head}{dot}{indices[int(k)]}.{tail}"
    head, dot, tail = rest.partition("mlp.experts.linear_fc")
    if dot:  # TEGroupedMLP: linear_fc1.weight{k}
        fc, _, k = tail.partition(".weight")
        return f"{head}{dot}{fc}.weight{indices[int(k)]}"
    return rest


def stage_table(model, arch: Arch, head: str = "lm") -> list[Param]:
    """The rows of ``param_map`` this stage holds (plus the tied embedding's copy on the last stage)."""
    params = stage_tensors(model)
    table = [p for p in param_map(arch, _uses_te(model), head=head) if p.megatron in params]
    if head == "lm" and arch.tie_word_embeddings and TIED_COPY.megatron in params:
        table.append(TIED_COPY)
    missing = sorted(set(params) - {p.megatron for p in table})
    if missing:
        raise ValueError(f"megatron parameters without an HF source: {missing}")
    return table


@torch.no_grad()
def load_hf_weights(model, path: str | Path, arch: Arch, head: str = "lm") -> None:
    """Copy an HF safetensors checkpoint into this rank's parameters (its TP shard of its PP stage's), reading only
    the tensors it needs. A critic from a causal-LM checkpoint (no ``score.weight``) gets a fresh head, the same on
    every rank: weight ~ N(0, initializer_range^2) from seed 0, bias 0 (HF's initialisation of the score layer)."""
    from megatron.core import parallel_state

    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    params = stage_tensors(model)
    reader = _SafetensorsReader(path)
    for p in stage_table(model, arch, head):
        target = params[p.megatron]
        if p.hf[0].startswith("score.") and not reader.has(p.hf[0]):
            std = json.loads((Path(path) / "config.json").read_text()).get("initializer_range", 0.02)
            fresh = torch.empty(target.shape).normal_(0.0, std, generator=torch.Generator().manual_seed(0))
            target.copy_(fresh if p.hf[0] == "score.weight" else torch.zeros(target.shape))
            continue
        local = shard(p, [reader.get(n) for n in p.hf], arch, rank, size)
        if local.shape != target.shape:
            raise ValueError(f"{p.megatron}: HF {list(p.hf)} shard to {tuple(local.shape)}, "
                             f"the model has {tuple(target.shape)}")
        target.copy_(local)


@torch.no_grad()
def iter_hf_weights(model, arch: Arch, tp_group, pp_group=None, head: str = "lm", ep_group=None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, full tensor) of every HF checkpoint entry, in HF order, one megatron parameter at a
    time. A parameter's owner is the stage holding its layer (pp > 1) and, for a routed expert e under expert
    parallelism, EP rank e // (E / ep) of that stage: the owner all-gathers its shards over TP and unshards them;
    an expert then goes to the rest of the stage's EP group (broadcast over ``ep_group``), and with pp > 1 every
    stage's PP peer of the same (TP, CP, DP) slot broadcasts the HF tensors over ``pp_group``. Collective over the
    groups: every rank of them must iterate to the end; every rank gets every tensor."""
    params = stage_tensors(model)
    size = dist.get_world_size(tp_group)
    table = param_map(arch, _uses_te(model), for_export=True, head=head)
    stages = 1 if pp_group is None else dist.get_world_size(pp_group)
    experts = 1 if ep_group is None else dist.get_world_size(ep_group)
    per_rank = arch.num_experts // experts if arch.num_experts else 0
    ep_me = 0 if experts == 1 else dist.get_rank(ep_group)
    # which stage holds what, and the HF shapes the other stages allocate to receive. PP peers share an EP rank,
    # so a stage is known to hold a layer's experts by the layer's router (``_held_as``)
    held = [{p.megatron: [t.shape for t in unshard(p, [params[p.megatron].to("meta")] * size, arch)]
             for p in table if p.megatron in params}]
    if stages > 1:
        mine, held = held[0], [None] * stages
        dist.all_gather_object(held, mine, group=pp_group)
    me = 0 if stages == 1 else dist.get_rank(pp_group)
    device = next(iter(params.values())).device
    for p in table:
        stage = next(s for s in range(stages) if _held_as(p) in held[s])
        owner = ep_me if p.expert is None or experts == 1 else p.expert // per_rank
        if (stage, owner) == (me, ep_me):
            tensors = _gathered(p, params[p.megatron].detach(), arch, tp_group)
        else:
            tensors = [torch.empty(shape, device=device) for shape in _hf_shapes(p, arch, held[stage])]
        if stage == me and p.expert is not None and experts > 1:
            for t in tensors:
                dist.broadcast(t, src=dist.get_global_rank(ep_group, owner), group=ep_group)
        if stages > 1:
            for t in tensors:
                dist.broadcast(t, src=dist.get_global_rank(pp_group, stage), group=pp_group)
        yield from zip(p.hf, tensors)


def _held_as(p: Param) -> str:
    """The megatron name by which a stage's holding of ``p`` is known: a routed expert's layer router (the stage's
    ranks hold only their EP rank's experts), any other parameter's own name."""
    return p.megatron if p.expert is None else p.megatron.split(".mlp.")[0] + ".mlp.router.weight"


def _hf_shapes(p: Param, arch: Arch, held: dict) -> list[tuple[int, ...]]:
    """The full HF shapes of ``p``'s tensors: a routed expert's gate / up [F, H] and down [H, F]; any other from
    the holding stage's ``held`` table."""
    if p.expert is None:
        return held[p.megatron]
    f, h = arch.moe_ffn_hidden_size, arch.hidden_size
    return [(f, h) if p.kind == "gate_up" else (h, f) for _ in p.hf]


def _gathered(p: Param, local: torch.Tensor, arch: Arch, tp_group) -> list[torch.Tensor]:
    """The HF tensors of ``p`` from this TP rank's shard ``local`` (all-gathered over TP unless replicated)."""
    size = dist.get_world_size(tp_group)
    if p.kind == "replicated" or size == 1:
        shards = [local] * size
    else:
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local.contiguous(), group=tp_group)
    return [t.contiguous() for t in unshard(p, shards, arch)]


class _SafetensorsReader:
    """Tensors of an HF checkpoint by name (one model.safetensors, or shards listed in its index)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (path / "model.safetensors").exists():
            with safe_open(path / "model.safetensors", framework="pt") as f:
                self.where = {k: path / "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors(.index.json); train=megatron reads safetensors")
        self.files = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"{name} is not in the checkpoint")
        file = self.where[name]
        if file not in self.files:
            self.files[file] = safe_open(file, framework="pt")
        return self.files[file].get_tensor(name).float()
