"""Data group schema: where prompts come from and how they become token ids."""

import re
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

from slime_hydra.options import Problem, choice, nearest, non_negative, positive, within

ON_BAD_LINE = ("error", "skip")
"""data.on_bad_line: what data/dataset.py does with a malformed row."""
TASKS = ("addition", "arithmetic", "countdown", "sorting", "calculator")
"""data.task: the built-in generated tasks, each a module of slime_hydra/data/tasks/ with that name."""
MAX_LEVELS = {"arithmetic": 8, "countdown": 5, "sorting": 10, "calculator": 6}
"""The environments (tasks generated at a difficulty level, data/tasks/env.py) and their highest level; levels
start at 1. addition is a fixed problem set without levels."""


@dataclass
class EvalDataConfig:
    name: str = "eval"
    """Name used in metric keys: eval/<name>/accuracy, eval/<name>/pass@k."""
    path: Optional[str] = None
    """JSONL or Parquet file of eval prompts; null uses the task's held-out split (built-in tasks only)."""
    n_samples_per_prompt: int = positive(1)
    """Responses per eval prompt (pass@k needs k <= this)."""
    temperature: float = non_negative(0.0)
    """Eval sampling temperature; 0 is greedy."""
    max_response_tokens: Optional[int] = positive(None)
    """Eval response budget in tokens; null means rollout.max_response_tokens."""
    max_prompts: Optional[int] = positive(None)
    """Evaluate only the first N prompts; null means all."""


@dataclass
class AdaptiveConfig:
    """Adaptive difficulty (data/adaptive.py): prompts generated on the fly at a level that follows the pass rate."""

    enabled: bool = False
    """Generate training prompts at a level that keeps each task's pass rate in [band_low, band_high]."""
    tasks: List[str] = field(default_factory=list)
    """Environments mixed prompt by prompt, round robin, each with its own level; empty means [data.task]."""
    band_low: float = within(0.3, 0.0, 1.0)
    """Target pass rate's lower edge (fraction of a group's samples correct): below it the level goes down."""
    band_high: float = within(0.7, 0.0, 1.0)
    """Target pass rate's upper edge: above it the level goes up."""
    window_groups: int = positive(32)
    """Scored groups at the current level whose mean pass rate is compared with the band; a move empties it."""
    min_level: int = positive(1)
    """Lowest level (levels start at 1)."""
    max_level: Optional[int] = positive(None)
    """Highest level; null means each task's own highest (data/config.MAX_LEVELS)."""
    start_level: Optional[int] = positive(None)
    """Level of the first prompts; null means min_level."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.band_low >= self.band_high:
            yield Problem((f"{prefix}band_low", f"{prefix}band_high"),
                          f"band_low={self.band_low} must be below band_high={self.band_high}",
                          f"set {prefix}band_low and {prefix}band_high to a band such as 0.3 and 0.7")
        if self.max_level is not None and self.max_level < self.min_level:
            yield Problem((f"{prefix}min_level", f"{prefix}max_level"),
                          f"max_level={self.max_level} is below min_level={self.min_level}",
                          f"set {prefix}max_level >= {self.min_level} (or null for each task's highest)")
        if self.start_level is not None and not (
                self.min_level <= self.start_level <= (self.max_level or self.start_level)):
            yield Problem((f"{prefix}start_level",),
                          f"start_level={self.start_level} is outside [min_level={self.min_level}, "
                          f"max_level={self.max_level}]", f"set {prefix}start_level=null (min_level) or a level inside")
        for i, name in enumerate(self.tasks):
            if name not in MAX_LEVELS:
                hint = nearest(str(name), MAX_LEVELS)
                yield Problem((f"{prefix}tasks.{i}",), f"'{name}' is not an environment with levels "
                              f"({', '.join(MAX_LEVELS)})",
                              f"did you mean {hint}?" if hint else f"choose among {', '.join(MAX_LEVELS)}")


@dataclass
class DataConfig:
    name: str = "addition"
    """The conf/data option this came from."""
    path: Optional[str] = None
    """Training prompts: a .jsonl or .parquet file; null uses the built-in task (`task`)."""
    task: Optional[str] = choice("addition", TASKS)
    """Built-in generated task used when path is null (offline, verifiable; data/tasks/): addition | arithmetic |
    countdown | sorting | calculator."""
    level: Optional[int] = positive(None)
    """Difficulty level of a generated task's prompts (not adaptive) and held-out split; null: the task's default."""
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    """Adaptive difficulty (training prompts generated on the fly); off by default."""
    prompt_key: str = "prompt"
    """Row key holding the prompt: a string, or a list of chat messages."""
    label_key: str = "label"
    """Row key holding the reference answer given to the reward function."""
    metadata_key: Optional[str] = None
    """Row key holding a dict passed to the reward as metadata; null for none."""
    tools_key: Optional[str] = None
    """Row key holding tool specs passed to the chat template; null for none."""
    response_key: str = "response"
    """algo=sft: the row key holding the target response; algo=dpo: the chosen one (a string; data/dataset.py)."""
    rejected_key: str = "rejected"
    """algo=dpo: the row key holding the rejected response (a string)."""
    apply_chat_template: bool = True
    """Render prompts through the tokenizer's chat template (with the generation prompt)."""
    max_prompt_tokens: int = positive(1024)
    """Prompts longer than this many tokens are filtered out (and counted) when the dataset loads."""
    row_start: int = non_negative(0)
    """First row used (0-based, inclusive)."""
    row_end: Optional[int] = None
    """Row after the last one used (exclusive); null means to the end."""
    shuffle: bool = True
    """Shuffle prompts every epoch with a permutation derived from (seed, epoch)."""
    seed: int = 1234
    """Shuffle seed."""
    on_bad_line: str = choice("error", ON_BAD_LINE)
    """error: stop at a malformed row naming file and line | skip: skip it and count it."""
    max_row_bytes: int = positive(1 << 20)
    """A JSONL line longer than this many bytes is a malformed row (too_large), never read whole: one hostile line
    cannot exhaust memory (a 60 MB line once grew a scan to 18 GB). Raise it for rows that inline images."""
    eval: List[EvalDataConfig] = field(default_factory=list)
    """Eval datasets, each with its own sampling settings."""

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if self.path is None and self.task is None:
            yield Problem((f"{prefix}path", f"{prefix}task"), "no prompts: both data.path and data.task are null",
                          "set data.path=/path/train.jsonl or data=addition")
        if self.path is not None and not self.path.endswith((".jsonl", ".parquet")):
            yield Problem((f"{prefix}path",), f"'{self.path}' is neither .jsonl nor .parquet",
                          "convert the dataset to JSONL or Parquet")
        if self.task is not None and self.task not in MAX_LEVELS and self.level is not None:
            yield Problem((f"{prefix}level",), f"data.task={self.task} is a fixed problem set without levels",
                          f"set {prefix}level=null, or choose an environment: {', '.join(MAX_LEVELS)}")
        if self.task in MAX_LEVELS and self.level is not None and self.level > MAX_LEVELS[self.task]:
            yield Problem((f"{prefix}level",), f"{self.task} has levels 1..{MAX_LEVELS[self.task]}, got {self.level}",
                          f"set {prefix}level between 1 and {MAX_LEVELS[self.task]}")
        if self.adaptive.enabled:
            if self.path is not None:
                yield Problem((f"{prefix}adaptive.enabled", f"{prefix}path"),
                              "adaptive difficulty generates its prompts, but data.path names a file",
                              f"set {prefix}path=null and {prefix}task to an environment, or "
                              f"{prefix}adaptive.enabled=false")
            elif not self.adaptive.tasks and self.task not in MAX_LEVELS:
                yield Problem((f"{prefix}adaptive.enabled", f"{prefix}task"),
                              f"adaptive difficulty needs an environment with levels; data.task={self.task} has none",
                              f"set {prefix}task to one of {', '.join(MAX_LEVELS)} (or list them in "
                              f"{prefix}adaptive.tasks)")
            low = [t for t in self.adaptive.tasks or [self.task]  # a task without levels is refused above
                   if t in MAX_LEVELS and MAX_LEVELS[t] < self.adaptive.min_level]
            if low:
                yield Problem((f"{prefix}adaptive.min_level",),
                              f"min_level={self.adaptive.min_level} is above the highest level of "
                              + ", ".join(f"{t} ({MAX_LEVELS[t]})" for t in low),
                              f"lower {prefix}adaptive.min_level")
        names = [e.name for e in self.eval]
        for i, name in enumerate(names):
            if not re.fullmatch(r"[\w.+=,@-]+", name) or set(name) == {"."}:
                yield Problem((f"{prefix}eval.{i}.name",), f"{name!r} is not a plain name (letters, digits and "
                              ". _ - + = , @): it names the metrics eval/<name>/...", f"set {prefix}eval.{i}.name=heldout")
            elif name in names[:i]:
                yield Problem((f"{prefix}eval.{i}.name",), f"two eval sets are called {name!r}: the second's metrics "
                              "would overwrite the first's", f"give {prefix}eval.{i}.name another name")
        if self.row_end is not None and self.row_end <= self.row_start:
            yield Problem((f"{prefix}row_start", f"{prefix}row_end"),
                          f"row_end={self.row_end} must be after row_start={self.row_start}")
