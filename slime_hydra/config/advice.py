"""Warnings, not refusals: settings that run but are likely not what the user meant, each naming the keys to look at.

    advice(cfg, derived) -> list[Problem]     launch.py prints them as "slime_hydra: warning: ..." and goes on

- a real model (``model.path`` set) on the tiny demo's task (``data=addition``, the default): two-digit sums teach
  a real model nothing, and the README's 9B example once planned itself on them silently;
- a real model served by the embedded engine (the default ``rollout.backend``) on a GPU site with several GPUs a
  node: it runs, but the embedded engine has no tensor parallelism (one GPU an engine) and was measured on small
  models only; SGLang (``rollout=sglang``) is the engine real runs on such sites use;
- GPUs of the allocation that nothing uses: the trainer ranks and the engines take fewer GPUs than the nodes have
  (``model=glm4_9b cluster=slurm_8xh100`` used 5 of 8), while the job holds and is billed for all of them.

Kept apart from config/rules.py, whose every finding stops the launch.
"""

from slime_hydra.config.derive import Derived
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Problem

DEMO_TASKS = ("addition",)
"""data.task values that exist for the CPU demo only."""


def advice(cfg: SlimeConfig, d: Derived) -> list[Problem]:
    out = []
    if cfg.model.path is not None and cfg.data.path is None and cfg.data.task in DEMO_TASKS:
        out.append(Problem(("data.task", "model.path"),
                           f"model.path is a real checkpoint, but data.task={cfg.data.task} is the CPU demo's "
                           "two-digit addition",
                           "choose its data: data=gsm8k, data=dapo_math_17k, or data=jsonl data.path=<your prompts>"))
    if cfg.model.path is not None and cfg.rollout.backend == "embedded" and cfg.cluster.gpus_per_node > 1:
        out.append(Problem(("rollout.backend", "model.path"),
                           f"model.path is a real checkpoint on a site of {cfg.cluster.gpus_per_node} GPUs a node, "
                           "served by rollout.backend=embedded (the default): slime_hydra's own engine, one GPU an "
                           "engine (no tensor parallelism), measured on models up to 7B",
                           "add rollout=sglang for SGLang servers, or keep the embedded engine knowingly"))
    held = d.nodes * d.gpus_per_node
    if cfg.cluster.gpus_per_node and d.total_gpus < held:
        share = ("the trainer ranks and the engines share " if cfg.cluster.colocate else
                 f"train.num_gpus={d.train_gpus} + rollout.num_gpus={d.rollout_gpus} = ")
        out.append(Problem(("train.num_gpus", "rollout.num_gpus"),
                           f"{share}{d.total_gpus} of the {held} GPUs the job holds ({d.nodes} node(s) x "
                           f"{d.gpus_per_node}): {held - d.total_gpus} idle",
                           f"give them to the engines (rollout.num_gpus={d.rollout_gpus + held - d.total_gpus}) or "
                           "the trainer, or set cluster.gpus_per_node to what the job should take"))
    return out
