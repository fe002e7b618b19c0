"""What the embedded engine holds of its model's weights, and every change to them (on the model thread):

- **Names.** ``tensors`` maps each name a weight update may use to its parameter or buffer: the HF model's names,
  tied weights under each of their names. ``aliases`` adds the names of a model served with LoRA adapters: the
  saved-adapter keys of its A and B matrices, and the plain HF names of its adapted linears.
- **Placement**: the sibling projections are stacked (stacking.py), then every parameter and buffer goes into one
  allocation of the memory's ``weights`` region (memory.py), which a release gives back and a resume restores at the
  same addresses.
- **Updates** (``load``): every name and shape is checked before anything is copied. Copies go into the live
  parameters in place (the CUDA graphs keep reading the same storage), or into their host copy while the weights
  are released.
- **Named adapters** (SGLang's LoRA protocol): ``add_adapter``, ``drop_adapter``, and ``activate``, which puts one
  into the adapter modules before a batch that uses it.
- **Weight-update groups**: the process groups that distributed updates arrive through.
"""

from typing import Any, Optional

import torch

from slime_hydra.rollout.engines.embedded import stacking
from slime_hydra.rollout.engines.embedded.memory import Releasable, place
from slime_hydra.rollout.engines.embedded.protocol import RequestError
from slime_hydra.weight_transport import adapter_key, destroy_weight_update_group


def _comparable(value):
    """A config value as compared between adapters: target-module lists in any order."""
    return frozenset(value) if isinstance(value, (list, tuple, set)) else value


def add_adapters(model: torch.nn.Module, lora: dict) -> None:
    """Add the adapter modules of a PEFT LoRA config to ``model``, kept in fp32 (as the trainer's PEFT model keeps
    them). B = 0 whatever the config says of its init: the engine serves the base until the trainer's adapter
    arrives."""
    import peft

    peft.inject_adapter_in_model(peft.LoraConfig(**{**lora, "init_lora_weights": True}), model)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.data = param.data.float()


class Weights:
    """The model's weights by name, in the weights region of the engine's memory; the named adapters and the
    weight-update groups."""

    def __init__(self, model: torch.nn.Module, memory: Releasable, lora: Optional[dict], stack: bool = True):
        """model: on the host; stacked (unless not ``stack``) and placed on ``memory``'s device here."""
        self.device = memory.device
        self.memory = memory
        self.lora = lora
        """The adapter config the model is served with (None: no adapters)."""
        self.stacked = stacking.stack(model) if stack else []
        """The modules whose sibling projections run as one matmul."""
        with memory.region("weights"):
            place(model, self.device)
        self.tensors = model.state_dict(keep_vars=True)
        """Name -> parameter/buffer (tied weights appear under each of their names) for loading updates."""
        self.aliases = self._adapter_aliases()
        """Names updates may use for tensors the model holds under PEFT's names (adapter keys, base weights)."""
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        """Named adapters (SGLang's /load_lora_adapter): name -> PEFT parameter name -> tensor (fp32, on the device)."""
        self.serving: Optional[str] = None
        """The named adapter whose A and B are in the model's adapter modules; None: the model's own adapter."""
        self._own: Optional[dict[str, torch.Tensor]] = None
        """While a named adapter is served: the model's own adapter (what updates by saved-adapter keys set)."""
        self._groups: dict[str, Any] = {}

    def _adapter_aliases(self) -> dict[str, str]:
        """adapter_key(m, X) -> ``m.lora_X.default.weight``; an adapted linear's HF name ``m.weight`` (``m.bias``)
        -> ``m.base_layer.weight`` (``.bias``), so full HF checkpoints still load."""
        aliases = {}
        for name in self.tensors:
            for which in "AB":
                if name.endswith(f".lora_{which}.default.weight"):
                    aliases[adapter_key(name[:-len(f".lora_{which}.default.weight")], which)] = name
            if ".base_layer." in name:
                aliases[name.replace(".base_layer.", ".")] = name
        return aliases

    def holds(self, name: str) -> bool:
        """Whether an update may name this tensor (a model name, or an alias of one)."""
        return self.aliases.get(name, name) in self.tensors

    def load(self, named: dict[str, torch.Tensor], complete: bool) -> None:
        """Copy tensors into the model (or its host copy while released); names/shapes are all checked before
        anything is copied. Names are the HF model's, or saved-adapter keys for the adapters of a model served with
        LoRA.

        complete: every weight of the kind given must be given (a disk reload: the whole model, or the whole
        adapter), counting tied weights once.
        """
        named = {self.aliases.get(name, name): tensor for name, tensor in named.items()}
        problems = []
        for name, tensor in named.items():
            target = self.tensors.get(name)
            if target is None:
                problems.append(f"unknown weight {name!r}")
            elif tuple(tensor.shape) != tuple(target.shape):
                problems.append(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(target.shape)}")
        if complete:
            covered = {id(self.tensors[n]) for n in named if n in self.tensors}
            adapter = all(".lora_" in n for n in named)
            missing = [n for n, t in self.tensors.items() if id(t) not in covered and (".lora_" in n) == adapter]
            if missing:
                problems.append(f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if problems:
            raise RequestError("; ".join(problems[:16]))
        own = {n: t for n, t in named.items() if self._own is not None and n in self._own}
        self._write({n: t for n, t in named.items() if n not in own})
        for name, tensor in own.items():  # a named adapter is in the modules: the model's own waits aside
            self._own[name].copy_(tensor)

    def _write(self, named: dict[str, torch.Tensor]) -> None:
        """Copy tensors, by the model's own names, into the live parameters (or their host copies)."""
        with torch.no_grad():
            for name, tensor in named.items():
                dest = self.memory.writable(self.tensors[name])
                dest.copy_(tensor.to(dest.device))

    # -- named adapters (SGLang's LoRA protocol) -------------------------------------------------------------------

    def adapter_problems(self, config: dict) -> list[str]:
        """Why a PEFT adapter_config cannot be served here: the adapter modules are those of ``--lora-config``, so a
        named adapter must have the same rank, alpha and target modules, and be a plain LoRA (no rsLoRA, DoRA or
        trained biases)."""
        if self.lora is None:
            return ["this engine serves no LoRA adapters: start it with --lora-config"]
        problems = [f"{key}={config.get(key)!r} differs from the served adapters' {self.lora.get(key)!r}"
                    for key in ("r", "lora_alpha", "target_modules")
                    if _comparable(config.get(key)) != _comparable(self.lora.get(key))]
        for key, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
            if config.get(key, plain) != plain:
                problems.append(f"{key}={config[key]!r} is not served (only {key}={plain!r})")
        return problems

    def add_adapter(self, name: str, named: dict[str, torch.Tensor]) -> None:
        """Keep a named adapter (every A and B of the served adapter modules, by saved-adapter keys)."""
        mapped = {self.aliases.get(k, k): t for k, t in named.items()}
        slots = {n: t for n, t in self.tensors.items() if ".lora_" in n}
        problems = [f"unknown adapter weight {k!r}" for k in named if self.aliases.get(k, k) not in slots]
        problems += [f"{n}: shape {tuple(t.shape)} != {tuple(slots[n].shape)}" for n, t in mapped.items()
                     if n in slots and tuple(t.shape) != tuple(slots[n].shape)]
        missing = sorted(set(slots) - set(mapped))
        if missing:
            problems.append(f"missing adapter weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if problems:
            raise RequestError("; ".join(problems[:16]))
        self.adapters[name] = {n: t.to(self.device, torch.float32) for n, t in mapped.items()}

    def drop_adapter(self, name: str) -> None:
        if self.serving == name:
            self.activate(None)
        del self.adapters[name]

    def activate(self, name: Optional[str]) -> None:
        """Put adapter ``name`` (None: the model's own) into the adapter modules, in place (the decode graphs read
        the same storage), before a batch that runs with it."""
        if name == self.serving:
            return
        if self.serving is None:
            self._own = {n: self.memory.writable(t).clone() for n, t in self.tensors.items() if ".lora_" in n}
        self._write(self._own if name is None else self.adapters[name])
        if name is None:
            self._own = None
        self.serving = name

    # -- weight-update groups --------------------------------------------------------------------------------------

    def check_new_group(self, name: str) -> None:
        if name in self._groups:
            raise RequestError(f"weight update group {name!r} exists; destroy it first")

    def add_group(self, name: str, group) -> None:
        self.check_new_group(name)
        self._groups[name] = group

    def group(self, name: str):
        if name not in self._groups:
            raise RequestError(f"no weight update group {name!r}; call /init_weights_update_group first "
                               f"(groups: {sorted(self._groups)})")
        return self._groups[name]

    def drop_group(self, name: str) -> None:
        destroy_weight_update_group(self.group(name))
        del self._groups[name]

    def leave_groups(self) -> None:
        """Destroy every weight update group (the engine is stopping)."""
        for group in self._groups.values():
            destroy_weight_update_group(group)
        self._groups.clear()
