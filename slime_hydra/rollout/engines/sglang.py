"""Real SGLang servers (``rollout=sglang``): the exact ``python -m sglang.launch_server`` command of each engine.

SGLang runs only on a prepared GPU cluster (it pins its own torch and CUDA kernels), so nothing here imports it:
the command line is rendered from the config and the pinned snapshot of SGLang's ``ServerArgs``
(``snapshots/sglang_server_args.json``), and ``EngineActor`` starts it through the same ``ServerProcess``
wrapper, health check (``GET /health_generate``), log file and stop/restart as the embedded engine. Everything
after start-up (generation, aborts, weight updates, memory release/resume) goes through SGLang's HTTP protocol
(``rollout/client.py``), which the embedded engine speaks too.

What the platform sets on every engine (``SGLANG_OWNED`` below refuses them in ``rollout.sglang``)::

    --model-path / --tokenizer-path   model.path
    --host --port --nccl-port         picked per engine at start (loopback on one machine, the node's IP on many)
    --tp-size                         rollout.gpus_per_engine (GPU ids: CUDA_VISIBLE_DEVICES from the Ray placement)
    --dtype                           bfloat16 when train.dtype=bf16, else float32 (the dtype weights are synced in)
    --random-seed                     seed + engine index (engines sample different streams)
    --context-length                  data.max_prompt_tokens + the largest response budget (rollout and eval sets)
    --weight-version                  the policy version the engine starts with ("0": the initial weights)
    --enable-memory-saver             cluster.colocate (engines release GPU memory while the trainer runs)
    --config FILE                     a YAML file holding ``api_key``: the run's key (rollout/auth.py)
    --enable-lora --max-lora-rank R --lora-target-modules M...
                                      train.lora with adapter sync (``Derived.lora_sync``): the engines apply the
                                      policy's adapter at run time, loaded at each sync by /load_lora_adapter

then every ``rollout.sglang`` option, in the order written, rendered from its snapshot entry the way SGLang's
argparse parser reads it back:

- a ``bool`` flag (argparse ``store_true``) appears only when true; ``BooleanOptionalAction`` flags render
  ``--x`` for true and ``--no-x`` for false;
- a list option (``nargs`` ``+`` or ``*``) is one flag followed by each value; an empty list is the bare flag
  under ``nargs='*'``;
- options SGLang parses as JSON (``json.loads``, ``json_list_type``, ``--cuda-graph-config``) take a dict or list,
  rendered as compact JSON (a string is passed through as written);
- ``lora_paths`` takes ``{name: path}`` (rendered ``name=path``), or a list of paths / ``{"lora_name", "lora_path"}``
  dicts;
- scalars are one flag and one value, checked against the snapshot's type and choices; ``null`` leaves SGLang's
  default (the option is not rendered).

The API key. SGLang 0.5.23 reads ``--api-key`` from its command line, where every local user could read it
(``/proc/<pid>/cmdline``), and has no environment variable for it; but ``--config FILE.yaml`` (``prepare_server_args``:
the file's keys become arguments in-process, before the command line's) takes any option, so the key goes in such a
file, written with mode 0600 by the engine actor (``api_key_config``). With ``api_key`` set SGLang answers 401 on
every endpoint but ``/health*`` and ``/metrics*``, weight updates and memory release included (they are
``ADMIN_OPTIONAL``: ``admin_api_key`` would take over, so the platform owns that option too).

``python -m slime_hydra.launch.sglang_commands [hydra overrides...]`` prints the command of every engine the
config would start (host and ports appear as ``$HOST``, ``$PORT``, ``$NCCL_PORT``: they are picked at start; the key
file as ``$API_KEY_CONFIG``: it is written at start); ``python launch.py rollout=sglang ... dry_run=true`` prints
them too, in the plan.
"""

import json
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from slime_hydra.options import ConfigError, Problem, passthrough_problems, snapshot

SGLANG_MODULE = "sglang.launch_server"
"""The module every engine runs (``python -m sglang.launch_server``)."""
INITIAL_WEIGHT_VERSION = "0"
"""The weight_version an engine starts with (the embedded engine's default too); syncs set the trainer's step."""

LORA_OWNER = ("train.lora.rank and train.lora.target_modules (with train.lora.sync=adapter the engines apply the "
              "policy's adapter)")

PLACEMENT = "set by the platform from the Ray placement (it picks ports, GPUs and addresses per engine)"

SGLANG_OWNED = {  # the ServerArgs fields each engine gets from the platform (the table above)
    "model_path": "model.path",
    "tokenizer_path": "model.path",
    "tp_size": "rollout.gpus_per_engine",
    "dp_size": "rollout.num_gpus (engines = rollout.num_gpus / rollout.gpus_per_engine)",
    "context_length": "data.max_prompt_tokens + rollout.max_response_tokens (derived)",
    "random_seed": "seed",
    "dtype": "train.dtype (engines compute in the dtype weights are synced in)",
    "weight_version": "the trainer's step (set by every weight sync)",
    "enable_memory_saver": "cluster.colocate (colocated engines release GPU memory while the trainer runs)",
    "host": PLACEMENT,
    "port": PLACEMENT,
    "base_gpu_id": PLACEMENT,
    "nccl_port": PLACEMENT,
    "dist_init_addr": PLACEMENT,
    "nnodes": PLACEMENT,
    "node_rank": PLACEMENT,
    "api_key": "the run's own key (rollout/auth.py: generated per run, given through --config)",
    "admin_api_key": "the run's own key (rollout/auth.py: an admin key would lock the trainer out of weight updates)",
    "enable_lora": LORA_OWNER,
    "max_lora_rank": LORA_OWNER,
    "lora_target_modules": LORA_OWNER,
}



def check_sglang_names(options: dict) -> Iterator[Problem]:
    """rollout.sglang keys that are no ServerArgs field, or that the platform sets itself."""
    yield from passthrough_problems("rollout.sglang", options, "sglang_server_args", SGLANG_OWNED)


_JSON_PARSERS = ("json.loads", "json_list_type", "parse_cuda_graph_config_arg")
_INT_TYPES = ("int", "Optional[int]")
_FLOAT_TYPES = ("float", "Optional[float]")
_STR_TYPES = ("str", "Optional[str]")

Port = Union[int, str]
"""A port number, or a placeholder such as ``$PORT`` when the command is only printed."""


@dataclass(frozen=True)
class SGLangLaunch:
    """Everything that decides an SGLang engine's command line, except where it runs (host, ports)."""

    model_path: str
    """HF checkpoint directory the server loads (model.path); also its tokenizer."""
    tp_size: int
    """Tensor-parallel size = GPUs per engine (rollout.gpus_per_engine)."""
    dtype: str
    """SGLang --dtype: bfloat16 | float32."""
    seed: int
    """Base sampling seed (the config's seed); engine i runs with seed + i."""
    context_tokens: int
    """--context-length in tokens: the longest prompt + response the rollout and eval sets ask for."""
    memory_saver: bool = False
    """--enable-memory-saver: colocated engines release and resume GPU memory around training."""
    lora_rank: int = 0
    """train.lora.rank when only the policy's LoRA adapter is synced (``--enable-lora``); 0: merged weights."""
    lora_targets: tuple[str, ...] = ()
    """train.lora.target_modules then (HF module names, SGLang's spelling too)."""
    options: dict = field(default_factory=dict)
    """rollout.sglang passthrough options (ServerArgs field name -> value), rendered after the platform's flags."""

    def command(self, index: int, host: str, port: Port, nccl_port: Port,
                weight_version: str = INITIAL_WEIGHT_VERSION, python: str = sys.executable,
                config: Optional[str] = None) -> list[str]:
        """The argv of engine ``index``: ``python -m sglang.launch_server ...``; config: the YAML file with the run's
        key (``api_key_config``; None: no key). ConfigError if an option cannot be rendered (every problem named by
        its rollout.sglang key)."""
        argv = [python, "-m", SGLANG_MODULE,
                "--model-path", self.model_path, "--tokenizer-path", self.model_path,
                "--host", host, "--port", str(port), "--nccl-port", str(nccl_port),
                "--tp-size", str(self.tp_size), "--dtype", self.dtype,
                "--random-seed", str(self.seed + index), "--context-length", str(self.context_tokens),
                "--weight-version", weight_version]
        if self.memory_saver:
            argv.append("--enable-memory-saver")
        if config is not None:
            argv += ["--config", config]
        if self.lora_rank:
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora_rank),
                     "--lora-target-modules", *sorted(self.lora_targets)]
        return argv + render_options(self.options)


def api_key_config(api_key: str) -> str:
    """The text of SGLang's ``--config`` file that sets its ``--api-key`` (a JSON string is a YAML string: the key
    reads back unchanged whatever its characters)."""
    return f"api_key: {json.dumps(api_key)}\n"


def launch_for(cfg, dtype: str, model_path: str | None = None, adapter: bool = False) -> SGLangLaunch:
    """The SGLangLaunch of a SlimeConfig (it reads model.path, rollout, data, seed and cluster.colocate); dtype:
    the engines' (``Derived.engine_dtype``); model_path: the checkpoint the run uses (default model.path); adapter:
    the run syncs the LoRA adapter alone (``Derived.lora_sync``; train.lora sizes the engines' adapters)."""
    path = model_path or cfg.model.path
    if path is None:
        raise ConfigError([Problem(("model.path", "rollout.backend"), "rollout=sglang needs a checkpoint directory",
                                   "set model.path=/path/to/hf_checkpoint")])
    budgets = [cfg.rollout.max_response_tokens] + [e.max_response_tokens for e in cfg.data.eval
                                                   if e.max_response_tokens is not None]
    return SGLangLaunch(
        model_path=str(path), tp_size=cfg.rollout.gpus_per_engine,
        dtype=dtype, seed=cfg.seed,
        context_tokens=cfg.data.max_prompt_tokens + max(budgets),
        memory_saver=cfg.cluster.colocate, lora_rank=cfg.train.lora.rank if adapter else 0,
        lora_targets=tuple(cfg.train.lora.target_modules) if adapter else (), options=dict(cfg.rollout.sglang))


# ---------------------------------------------------------------------------------------------------------------------
# Passthrough options -> argv
# ---------------------------------------------------------------------------------------------------------------------

def render_options(options: dict) -> list[str]:
    """rollout.sglang -> argv fragment, in the order written; ConfigError listing every problem."""
    problems = list(check_sglang_names(options)) + list(value_problems(options))
    if problems:
        raise ConfigError(problems)
    specs = snapshot("sglang_server_args")["options"]
    argv: list[str] = []
    for key, value in options.items():
        argv += _render(key, specs[key], value)
    return argv


def value_problems(options: dict) -> Iterator[Problem]:
    """Values that cannot be rendered (wrong type, not a choice, no command-line flag); keys whose name is
    unknown or platform-owned are left to ``check_sglang_names``."""
    names = {p.keys[0] for p in check_sglang_names(options)}
    specs = snapshot("sglang_server_args")["options"]
    version = snapshot("sglang_server_args")["version"]
    for key, value in options.items():
        dotted = f"rollout.sglang.{key}"
        if dotted in names:
            continue
        try:
            _render(key, specs[key], value)
        except _Unrenderable as error:
            yield Problem((dotted,), f"{error.message} (SGLang {version})", error.fix)
    if isinstance(options.get("tokenizer_worker_num"), int) and options["tokenizer_worker_num"] > 1:
        yield Problem(("rollout.sglang.tokenizer_worker_num",),
                      f"SGLang {version} refuses an API key with several tokenizer workers, and every engine of a "
                      "run requires the run's key", "remove rollout.sglang.tokenizer_worker_num (1 worker)")


class _Unrenderable(ValueError):
    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


def _flag(spec: dict) -> str:
    """The option's current spelling: its first flag that is not a deprecated one."""
    deprecated = set(spec.get("deprecated_flags") or ())
    return next((f for f in spec["flags"] if f not in deprecated), spec["flags"][0])


def _render(key: str, spec: dict, value: Any) -> list[str]:
    """One option -> its argv items (empty when the option keeps SGLang's default); _Unrenderable if it can't."""
    if not spec["flags"]:
        raise _Unrenderable(f"'{key}' has no command-line flag ({spec['cli']})",
                            f"remove rollout.sglang.{key}: SGLang sets it internally")
    if value is None:
        return []
    flag, kind, action = _flag(spec), spec["type"], spec.get("action")
    if action == "argparse.BooleanOptionalAction":
        _expect(key, value, bool, "true or false")
        return [flag] if value else ["--no-" + flag[2:]]
    if action == "LoRAPathAction":
        return [flag] + _lora_paths(key, value)
    if kind in ("bool", "Optional[bool]"):
        _expect(key, value, bool, "true or false")
        return [flag] if value else []
    if spec.get("type_parser") in _JSON_PARSERS:
        if isinstance(value, (dict, list)):
            return [flag, json.dumps(value, separators=(",", ":"))]
        _expect(key, value, str, "a dict, a list, or a JSON string")
        return [flag, value]
    if "List[" in kind and spec.get("type_parser") is None:
        return _list(key, spec, flag, value)
    return [flag, _scalar(key, spec, value)]


def _expect(key: str, value: Any, types, what: str) -> None:
    ok = isinstance(value, types) and not (types is not bool and isinstance(value, bool))
    if not ok:
        raise _Unrenderable(f"'{key}' takes {what}, got {value!r}", f"set rollout.sglang.{key} to {what}")


def _lora_paths(key: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [f"{name}={path}" for name, path in value.items()]
    if isinstance(value, list):
        items = []
        for item in value:
            if isinstance(item, dict) and {"lora_name", "lora_path"} <= set(item):
                items.append(json.dumps(item, separators=(",", ":")))
            elif isinstance(item, str):
                items.append(item)
            else:
                raise _Unrenderable(f"'{key}' entry {item!r} is neither a path nor a {{lora_name, lora_path}} dict",
                                    f"write rollout.sglang.{key} as {{name: path}} or a list of paths")
        return items
    _expect(key, value, str, "{name: path}, or a list of paths")
    return [value]


def _list(key: str, spec: dict, flag: str, value: Any) -> list[str]:
    nargs = spec.get("nargs") or "+"
    if not isinstance(value, list):
        raise _Unrenderable(f"'{key}' takes a list, got {value!r}", f"write rollout.sglang.{key} as [a, b, ...]")
    if not value and nargs == "+":
        raise _Unrenderable(f"'{key}' needs at least one value on the command line",
                            f"remove rollout.sglang.{key} to keep SGLang's default")
    element = spec["type"].split("List[", 1)[1].split("]", 1)[0]
    return [flag] + [_scalar(key, {"type": element, "choices": spec.get("choices")}, v) for v in value]


def _scalar(key: str, spec: dict, value: Any) -> str:
    kind, choices = spec["type"], spec.get("choices")
    if choices:
        if value not in choices:
            raise _Unrenderable(f"'{key}'={value!r} is not one of {choices}",
                                f"set rollout.sglang.{key} to one of them")
        return str(value)
    if kind in _INT_TYPES:
        if spec.get("type_parser") == "human_readable_int" and isinstance(value, str):
            return value  # SGLang reads suffixes such as 32k or 4Mi
        _expect(key, value, int, "an integer")
    elif kind in _FLOAT_TYPES:
        _expect(key, value, (int, float), "a number")
    elif kind in _STR_TYPES or kind.startswith(("Literal", "Optional[Literal")):
        _expect(key, value, (str, int, float), "a string")
    elif isinstance(value, (dict, list, bool)):
        raise _Unrenderable(f"'{key}' ({kind}) takes one plain value on the command line, got {value!r}",
                            f"set rollout.sglang.{key} to a string")
    return str(value)


# ---------------------------------------------------------------------------------------------------------------------
# Printing the commands
# ---------------------------------------------------------------------------------------------------------------------

def engine_commands(cfg, derived) -> list[str]:
    """One shell line per engine of a SlimeConfig and its Derived values, with $HOST / $PORT / $NCCL_PORT /
    $API_KEY_CONFIG where values are picked, or files written, at start."""
    launch = launch_for(cfg, derived.engine_dtype, cfg.model.path or "$MODEL_PATH", derived.lora_sync == "adapter")
    num_engines = derived.num_engines
    lines = []
    for i in range(num_engines):
        argv = launch.command(i, "$HOST", "$PORT", "$NCCL_PORT", python="python", config="$API_KEY_CONFIG")
        gpus = f"{launch.tp_size} GPU{'s' if launch.tp_size > 1 else ''} of the placement"
        lines.append(f"# engine {i} of {num_engines} ({gpus}; CUDA_VISIBLE_DEVICES set from Ray)\n"
                     + " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv))
    return lines
