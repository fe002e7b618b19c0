"""LoRA on megatron-core's tensor-parallel linears: the same function as PEFT's adapters on the HF modules.

Per HF module m (q_proj ... down_proj) with input x, PEFT computes

    y_m = W_m x + s * B_m (A_m dropout(x)),   s = alpha / rank,   A_m [rank, in], B_m [out_m, rank]

Megatron fuses q/k/v into ``linear_qkv`` (rows interleaved per query group: [q heads of g; k_g; v_g] for each group
g, then split over TP; convert.py) and gate/up into ``linear_fc1`` ([gate rows of rank t; up rows of rank t]). A
fused linear keeps one adapter per targeted HF module, ``<linear>.lora.adapters.<hf module>.{A, B}``, and scatters each
module's s * B_m A_m x into that module's rows of the fused, TP-split output; untargeted modules add nothing.
The adapter is added by a forward hook on the linear (any class: megatron's column-parallel linear, spec.py's
row-parallel subclass), so the base parameters keep their names and the converter its table.

Tensor parallelism (t ranks, rank i):
- column-parallel (linear_qkv, linear_fc1): x is the same on every rank. A_m is replicated, B_m holds this rank's
  rows of the module (as W does): out_i += s * B_m,i (A_m x). ``A_m x`` passes megatron's copy-to-TP region
  (forward: identity; backward: all-reduce), so d loss / d(A_m x) = sum_i B_m,i^T g_i: A_m's gradient and the
  LoRA path's gradient on x are complete, and equal, on every rank (no gradient reduction afterwards) at the cost
  of a [s, b, rank] all-reduce per adapter in the backward.
- row-parallel (linear_proj, linear_fc2): x is split on its features; A_m holds this rank's input columns (as W
  does), B_m is replicated. ``A_m,i x_i`` is summed over TP first (megatron's reduce-from-TP region: forward
  all-reduce of [s, b, rank], backward identity), then out += s * B_m (sum_i A_m,i x_i). This is B_m A_m x on every
  rank with identical values (a row-parallel output is replicated), B_m's gradient g (A_m x)^T is complete on every
  rank, and A_m,i's is (B_m^T g) x_i^T, exactly its columns of the full gradient. (Adding B_m A_m,i x_i to the
  partial products before megatron's all-reduce would save the small all-reduce but leave B_m's gradient partial.)

Dropout (train.lora.dropout, training only) draws from each rank's torch RNG: under TP a column-parallel adapter
would need the same mask on every rank, so dropout > 0 is refused with tp > 1.

Initialisation (PEFT's): A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a = sqrt(5)) from a generator seeded
by (layer, module), drawn at full size and then split, so every TP rank agrees; B = 0, so the step-0 policy is the
base model exactly (adding s * B (A x) = 0 changes no bit).
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from slime_hydra.train.config import LoraConfig
from slime_hydra.train.lora import merge
from slime_hydra.weight_transport import adapter_key
from slime_hydra.train.megatron.model import Arch

LINEARS = (
    ("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj"), "column"),
    ("self_attention.linear_proj", "self_attn", ("o_proj",), "row"),
    ("mlp.linear_fc1", "mlp", ("gate_proj", "up_proj"), "column"),
    ("mlp.linear_fc2", "mlp", ("down_proj",), "row"),
)
"""(megatron linear in a layer, HF parent module, the HF modules it fuses, TP kind), in HF module order."""
MODULE_ORDER = tuple(m for _, _, modules, _ in LINEARS for m in modules)


class Adapter(torch.nn.Module):
    """One HF module's A [rank, in / split] and B [out / split, rank] on this TP rank."""

    def __init__(self, rank: int, in_local: int, out_local: int, device):
        super().__init__()
        self.A = torch.nn.Parameter(torch.empty(rank, in_local, device=device))
        self.B = torch.nn.Parameter(torch.zeros(out_local, rank, device=device))


class FusedLora(torch.nn.Module):
    """The adapters of one megatron linear, added to its output by ``hook`` (module docstring)."""

    def __init__(self, modules: dict[str, tuple[int, int]], kind: str, lora: LoraConfig, tp_group, device,
                 qkv_layout: tuple[int, int, int] | None = None):
        """``modules``: every HF module the linear fuses -> (in, out) of this rank's share; targeted ones get an
        Adapter. ``qkv_layout``: (query groups on this rank, query heads per group, head dim) for linear_qkv."""
        super().__init__()
        self.kind, self.scale, self.tp_group, self.qkv_layout = kind, lora.scale, tp_group, qkv_layout
        self.rows = {m: out for m, (_, out) in modules.items()}
        self.adapters = torch.nn.ModuleDict({m: Adapter(lora.rank, i, o, device) for m, (i, o) in modules.items()
                                             if m in lora.target_modules})
        self.dropout = lora.dropout
        self.enabled = True

    @staticmethod
    def hook(linear, args, output):
        """Forward hook of the linear: (out + s * B (A x), bias); unchanged while the adapters are off."""
        lora = linear.lora
        if not lora.enabled:
            return output
        out, bias = output
        return out + lora(args[0]), bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """s * B (A x) of each targeted module in its rows of this rank's output [s, b, out_local]."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        tp = dist.get_world_size(self.tp_group)
        pieces = {}
        for name, adapter in self.adapters.items():
            ax = F.linear(x, adapter.A)
            if tp > 1:
                ax = (copy_to_tensor_model_parallel_region(ax, self.tp_group) if self.kind == "column"
                      else reduce_from_tensor_model_parallel_region(ax, self.tp_group))
            pieces[name] = F.linear(ax, adapter.B) * self.scale
        if len(self.rows) == 1:
            return next(iter(pieces.values()))
        full = [pieces[m] if m in pieces else x.new_zeros(*x.shape[:-1], rows) for m, rows in self.rows.items()]
        if self.qkv_layout is None:  # [gate; up]
            return torch.cat(full, dim=-1)
        groups, per_group, d = self.qkv_layout
        q, k, v = (t.view(*x.shape[:-1], groups, -1, d) for t in full)
        return torch.cat((q, k, v), dim=-2).flatten(-3)


class MegatronLora:
    """The adapters of one pipeline stage's GPTModel: attached to its linears, their names, full gathers, loading,
    merged weights, and the switch for the reference policy."""

    def __init__(self, model, arch: Arch, lora: LoraConfig, tp_group, pp_group=None):
        """pp_group: the pipeline group when pp > 1 (each stage holds its layers' adapters; ``iter_full`` sends
        them to every stage)."""
        if arch.is_mla:  # config/rules.check_lora refuses it first
            raise ValueError("train.lora.rank > 0: LoRA on multi-latent attention (DeepSeek-V3) is not built for "
                             "train=megatron; use train=fsdp with train.lora.target_modules=[o_proj]")
        self.arch, self.lora, self.tp_group, self.pp_group = arch, lora, tp_group, pp_group
        self.tp_rank, self.tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        self.entries: list[tuple[str, str, Adapter, str]] = []
        """(HF module path, megatron name prefix of its adapter, adapter, TP kind) in HF state-dict order."""
        device = next(model.parameters()).device
        h, t, d = arch.hidden_size, self.tp_size, arch.head_dim
        shapes = {"q_proj": (h, arch.num_attention_heads * d), "k_proj": (h, arch.num_kv_heads * d),
                  "v_proj": (h, arch.num_kv_heads * d), "o_proj": (arch.num_attention_heads * d, h),
                  "gate_proj": (h, arch.ffn_hidden_size), "up_proj": (h, arch.ffn_hidden_size),
                  "down_proj": (arch.ffn_hidden_size, h)}
        self.fused: list[FusedLora] = []
        for layer in model.decoder.layers:
            g = layer.layer_number - 1  # global layer number (convert.stage_parameters)
            for path, parent, modules, kind in LINEARS:
                if not set(modules) & set(lora.target_modules):
                    continue
                if path.startswith("mlp.") and not hasattr(layer.mlp, "linear_fc1"):
                    raise ValueError(f"train.lora.target_modules={list(lora.target_modules)}: layer {g} holds its "
                                     "MLP as routed experts, which LoRA does not adapt; adapt the attention: "
                                     "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
                linear = layer.get_submodule(path)
                local = {m: (i // t, o) if kind == "row" else (i, o // t) for m, (i, o) in
                         ((m, shapes[m]) for m in modules)}
                layout = ((arch.num_kv_heads // t, arch.heads_per_group, d) if path.endswith("linear_qkv") else None)
                fused = FusedLora(local, kind, lora, tp_group, device, layout)
                linear.lora = fused
                linear.register_forward_hook(FusedLora.hook)
                self.fused.append(fused)
                for m, adapter in fused.adapters.items():
                    self.entries.append((f"model.layers.{g}.{parent}.{m}",
                                         f"decoder.layers.{g}.{path}.lora.adapters.{m}", adapter, kind))
        self._initialise()

    @torch.no_grad()
    def _initialise(self) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) at full size from seed (layer * 16 + module index), split; B = 0."""
        for module, _, adapter, kind in self.entries:
            layer, name = int(module.split(".")[2]), module.rsplit(".", 1)[1]
            fan_in = adapter.A.shape[1] * (self.tp_size if kind == "row" else 1)
            generator = torch.Generator().manual_seed(layer * 16 + MODULE_ORDER.index(name))
            full = torch.empty(adapter.A.shape[0], fan_in).uniform_(-fan_in ** -0.5, fan_in ** -0.5,
                                                                     generator=generator)
            adapter.A.copy_(self._shard(full, "A", kind))
            adapter.B.zero_()

    def _shard(self, full: torch.Tensor, which: str, kind: str) -> torch.Tensor:
        """This TP rank's part: column B rows, row A columns, the rest replicated."""
        dim = _split_dim(kind, which)
        return full if dim is None else full.chunk(self.tp_size, dim=dim)[self.tp_rank]

    def parameter_names(self) -> set[str]:
        """Megatron names (global layer numbers) of every adapter parameter."""
        return {f"{prefix}.{w}" for _, prefix, _, _ in self.entries for w in "AB"}

    def parameters(self) -> list[torch.nn.Parameter]:
        """Every adapter parameter."""
        return [p for _, _, adapter, _ in self.entries for p in (adapter.A, adapter.B)]

    def tp_split_names(self) -> set[str]:
        """Adapter parameters split over TP: column-parallel B, row-parallel A (the others are replicated)."""
        return {f"{prefix}.{'B' if kind == 'column' else 'A'}" for _, prefix, _, kind in self.entries}

    @contextmanager
    def disabled(self):
        """The base model: every adapter off for the block (the reference policy)."""
        for fused in self.fused:
            fused.enabled = False
        try:
            yield
        finally:
            for fused in self.fused:
                fused.enabled = True

    @torch.no_grad()
    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(adapter key, full A or B) of every adapter of the model in HF order, gathered over TP on the stage that
        holds it and (pp > 1) broadcast from there over PP: every rank gets every adapter. Collective over TP and
        PP."""
        mine = [(adapter_key(module, which), tuple(getattr(adapter, which).shape), kind, which)
                for module, _, adapter, kind in self.entries for which in "AB"]
        stages = 1 if self.pp_group is None else dist.get_world_size(self.pp_group)
        held = [mine]
        if stages > 1:  # every stage's keys and local shapes, stage by stage: layers follow the stages in order
            held = [None] * stages
            dist.all_gather_object(held, mine, group=self.pp_group)
        me = 0 if stages == 1 else dist.get_rank(self.pp_group)
        local = {adapter_key(module, w): getattr(adapter, w) for module, _, adapter, _ in self.entries for w in "AB"}
        device = next(iter(local.values())).device if local else torch.device("cpu")
        for stage, entries in enumerate(held):
            for key, shape, kind, which in entries:
                if stage == me:
                    tensor = self._gathered(local[key].detach(), kind, which)
                else:
                    dim = _split_dim(kind, which)
                    full = list(shape)
                    if dim is not None:
                        full[dim] *= self.tp_size
                    tensor = torch.empty(full, device=device)
                if stages > 1:
                    dist.broadcast(tensor, src=dist.get_global_rank(self.pp_group, stage), group=self.pp_group)
                yield key, tensor

    def _gathered(self, local: torch.Tensor, kind: str, which: str) -> torch.Tensor:
        """The full A or B from this TP rank's part (all-gathered over TP where it is split)."""
        dim = _split_dim(kind, which)
        if dim is None or self.tp_size == 1:
            return local.clone()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    @torch.no_grad()
    def load(self, adapter_dir: str | Path) -> None:
        """Set every adapter from a PEFT directory's adapter_model.safetensors (e.g. PeftModel.save_pretrained's or
        export_adapter's); each rank takes its part. Every adapter must be there, with the same rank."""
        tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
        wanted = {adapter_key(module, w): (adapter, w, kind) for module, _, adapter, kind in self.entries
                  for w in "AB"}
        missing = sorted(set(wanted) - set(tensors))
        if missing:
            raise ValueError(f"{adapter_dir}: no {missing[:3]} ... ({len(missing)} adapter tensors missing)")
        for key, (adapter, which, kind) in wanted.items():
            local = self._shard(tensors[key].float(), which, kind)
            target = getattr(adapter, which)
            if local.shape != target.shape:
                raise ValueError(f"{key}: {tuple(tensors[key].shape)} does not fit train.lora.rank="
                                 f"{self.lora.rank} here ({tuple(target.shape)} on this TP rank)")
            target.copy_(local)

    def merged(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs with W + s * B A (lora.merge) in place of every adapted module's weight.
        Collective over TP (the adapters are gathered first; they are small)."""
        full = dict(self.iter_full())
        for name, tensor in weights:
            module = name[:-len(".weight")] if name.endswith(".weight") else None
            a = full.get(adapter_key(module, "A")) if module else None
            yield name, tensor if a is None else merge(tensor, a, full[adapter_key(module, "B")], self.lora.scale)


def _split_dim(kind: str, which: str):
    """The dimension TP splits: column-parallel B's rows, row-parallel A's columns; None: replicated."""
    return {("column", "B"): 0, ("row", "A"): 1}.get((kind, which))


def trainable_bias(name: str, lora: LoraConfig) -> bool:
    """Whether the base parameter ``name`` trains beside the adapters (train.lora.bias): the fused q/k/v bias is the
    only linear bias megatron holds here; lora_only trains it when q, k and v are adapted (``problems`` refuses a
    part of them)."""
    if not name.endswith("linear_qkv.bias"):
        return False
    return lora.bias == "all" or (lora.bias == "lora_only" and "q_proj" in lora.target_modules)
