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

With fewer query groups than TP ranks megatron still splits the interleaved QKV rows evenly (and all-gathers the
projection), which the same rule covers. TransformerEngine's spec fuses the pre-attention and pre-MLP norms into
the next linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the table follows it.

Pipeline parallelism: the table uses global layer numbers (``decoder.layers.{i}``, as at PP=1); a stage's module
numbers its layers from 0, so ``stage_parameters`` renames them by each layer's global ``layer_number``. A stage
loads only the table rows it holds; export gathers a parameter over TP on the stage holding it and broadcasts the
HF tensors over the PP group, so every rank sees every HF tensor.

The PPO critic (head="value") has HF *ForTokenClassification names: the same trunk and ``score.{weight, bias}``
(megatron ``output_layer.{weight, bias}``, replicated), no lm_head.
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
    """replicated | vocab | row | qkv | gate_up (see the module docstring)."""


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
        out.append(Param(m + "self_attention.linear_qkv.weight", qkv, "qkv"))
        if arch.qkv_bias:
            out.append(Param(m + "self_attention.linear_qkv.bias", tuple(n[:-6] + "bias" for n in qkv), "qkv"))
        if arch.qk_norm:
            out.append(Param(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
            out.append(Param(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
        out.append(Param(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"))
        if arch.sandwich_norm:
            out.append(Param(m + "self_attn_bda.norm.weight", (h + "post_self_attn_layernorm.weight",), "replicated"))
        out.append(Param(m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"),
                         (h + "post_attention_layernorm.weight",), "replicated"))
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


# ---- one tensor: HF -> this rank's shard, all ranks' shards -> HF ---------------------------------------------
def shard(p: Param, hf: list[torch.Tensor], arch: Arch, rank: int, size: int) -> torch.Tensor:
    """This TP rank's megatron tensor made from the HF tensors of ``p``."""
    if p.kind == "replicated":
        return hf[0]
    if p.kind == "vocab":
        return hf[0].chunk(size, dim=0)[rank]
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
    if p.kind == "vocab":
        return [torch.cat(shards, dim=0)]
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
    """This pipeline stage's parameters under their global (PP=1) names: ``decoder.layers.{j}`` of the stage is
    layer ``layer_number - 1`` of the model."""
    out = {}
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{model.decoder.layers[int(local)].layer_number - 1}.{rest}"
        out[name] = param
    return out


def stage_table(model, arch: Arch, head: str = "lm") -> list[Param]:
    """The rows of ``param_map`` this stage holds (plus the tied embedding's copy on the last stage)."""
    params = stage_parameters(model)
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
    params = stage_parameters(model)
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
def iter_hf_weights(model, arch: Arch, tp_group, pp_group=None, head: str = "lm"
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every HF state-dict entry, in HF order, one megatron parameter at a time: the stage
    holding it all-gathers its shards over TP and unshards them, then (pp > 1) broadcasts the HF tensors over the
    PP group. Collective over both groups: every rank of them must iterate to the end; every rank gets every
    tensor."""
    params = stage_parameters(model)
    size = dist.get_world_size(tp_group)
    table = param_map(arch, _uses_te(model), for_export=True, head=head)
    stages = 1 if pp_group is None else dist.get_world_size(pp_group)
    held = [{p.megatron: [t.shape for t in unshard(p, [params[p.megatron].to("meta")] * size, arch)]
             for p in table if p.megatron in params}]
    if stages > 1:  # which stage holds what, and the HF shapes the others allocate to receive
        mine, held = held[0], [None] * stages
        dist.all_gather_object(held, mine, group=pp_group)
    me = 0 if stages == 1 else dist.get_rank(pp_group)
    for p in table:
        owner = next(s for s in range(stages) if p.megatron in held[s])
        if owner == me:
            local = params[p.megatron].detach()
            if p.kind == "replicated" or size == 1:
                shards = [local] * size
            else:
                shards = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            tensors = [t.contiguous() for t in unshard(p, shards, arch)]
        else:
            device = next(iter(params.values())).device
            tensors = [torch.empty(shape, device=device) for shape in held[owner][p.megatron]]
        if stages > 1:
            for t in tensors:
                dist.broadcast(t, src=dist.get_global_rank(pp_group, owner), group=pp_group)
        yield from zip(p.hf, tensors)


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
