"""``python launch.py --help``: slime_hydra's own help, generated from conf/ and the schema so it cannot go stale.

Each group with its options (the default marked) and the first sentence of each option's YAML comment, the recipes
and sweeps with theirs, the keys users set most with the first sentence of their docstrings (options.field_doc), dry
runs, exit codes and where the docs are. Hydra's own flags stay behind ``--hydra-help``.
"""

import re
from pathlib import Path

from slime_hydra import preempt
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.config.store import GROUP_SCHEMAS
from slime_hydra.options import ConfigError, field_doc

MOST_USED = ("model.path", "num_steps", "rollout.batch_prompts", "rollout.n_samples_per_prompt",
             "rollout.max_response_tokens", "train.lr", "train.num_gpus", "rollout.num_gpus", "cluster.colocate",
             "cluster.gpus_per_node", "train.dtype", "run_name", "resume", "seed")
"""The keys shown with their docstrings (every other key: docs/config.md and its schema dataclass)."""


def first_sentence(text: str) -> str:
    """The text up to its first sentence end (whole, when there is none): YAML comments and docstrings wrap
    mid-sentence, so their first line would print half a sentence. A sentence ends at ``.``, ``!`` or ``?`` and a
    space, except after an abbreviation (a word of one or two letters, or with a dot inside: "Dr.", "e.g.")."""
    joined = " ".join(text.split())
    for match in re.finditer(r"(\S+)[.!?] ", joined):
        word = match.group(1)
        if len(word) > 2 and "." not in word:
            return joined[:match.end() - 1]
    return joined


def _describe(path: Path) -> str:
    """The first sentence of an option YAML's leading comment (its lines joined, the ``@package`` directive
    skipped)."""
    comment = []
    for line in path.read_text().splitlines():
        if line.startswith("#") and "@package" not in line:
            comment.append(line.lstrip("#").strip())
        elif comment:
            break
    return first_sentence(" ".join(comment))


def _defaults(conf: Path) -> dict[str, str]:
    """group -> the option conf/config.yaml's defaults list picks."""
    return dict(re.findall(r"^  - (\w+): (\w+)\s*$", (conf / "config.yaml").read_text(), flags=re.M))


def render_help(root: Path) -> str:
    conf = root / "conf"
    defaults = _defaults(conf)
    lines = ["slime_hydra: RL post-training of LLMs from one Hydra config (GRPO, GSPO, DAPO, PPO, ...).", "",
             "usage: python launch.py [group=option ...] [key=value ...]    one run (the embedded default without args)",
             "       python launch.py ... dry_run=true                      validate and print the plan; start nothing",
             "       python launch.py -m sweeps=<name> [key=a,b ...]       a sweep: every point validated first",
             "       python launch.py --cfg job                             print the composed config only", "",
             "groups (group=option):"]
    for group in GROUP_SCHEMAS:
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        default = defaults.get(group)
        for k, option in enumerate(options):
            name = f"{option} (default)" if option == default else option
            lines.append(f"  {group if k == 0 else '':9s} {name:22s} {_describe(conf / group / f'{option}.yaml')}")
    for kind, how in (("recipes", "recipes=<name>"), ("sweeps", "-m sweeps=<name>")):
        lines += ["", f"{kind} ({how}):"]
        lines += [f"  {p.stem:45s} {_describe(p)}" for p in sorted((root / kind).glob("*.yaml"))]
    lines += ["", "most used keys (key=value; every key is documented in slime_hydra/<group>/config.py):"]
    for key in MOST_USED:
        lines.append(f"  {key:30s} {first_sentence(field_doc(SlimeConfig, key))}")
    lines += ["", "exit codes: 0 finished | "
              f"{ConfigError.exit_code} config error (every problem named, nothing started) | "
              f"{preempt.EXIT_CODE} preempted: a checkpoint was written, run the same command again to resume | "
              "1 a failure",
              "docs: README.md, docs/architecture.md, docs/config.md, docs/loop.md, docs/rollout.md, docs/training.md,"
              " docs/slurm.md", "Hydra's own flags: python launch.py --hydra-help"]
    return "\n".join(lines)
