#!/usr/bin/env python
"""slime_hydra's one entry point: compose the Hydra config -> validate -> plan (dry_run=true) or run.

    python launch.py                                   the embedded default (tiny model, GRPO, this CPU)
    python launch.py model=qwen3_8b algo=dapo model.path=/ckpt/Qwen3-8B cluster=slurm_8xh100 dry_run=true
    python launch.py recipes=qwen3_4b_grpo_8xh100      a shared experiment (recipes/)
    python launch.py -m sweeps=kl_x_lr                 a sweep (sweeps/)
    python launch.py --cfg job                         print the composed config and exit
    python launch.py --help                            groups, options, the most used keys, exit codes, docs
"""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("SLIME_HYDRA_ROOT", ROOT)  # conf/config.yaml adds it to the search path: recipes/, sweeps/
# transformers' "Loading weights" / "Writing model shards" bars (read at its import; the Ray workers, their engines
# and a SLURM job inherit it: cluster/local_ray.connect): a run's console and logs show its own progress only
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from slime_hydra.config import PROJECT_ROOT, register_configs  # noqa: E402
from slime_hydra.launch import launch, precheck_argv  # noqa: E402

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    launch(cfg)


if __name__ == "__main__":
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        from slime_hydra.launch.help import render_help

        print(render_help(PROJECT_ROOT))
        raise SystemExit(0)
    precheck_argv(sys.argv[1:])
    main()
