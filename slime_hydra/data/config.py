"""Data group schema: where prompts come from and how they become token ids."""

from dataclasses import dataclass, field
from typing import Iterator, List, Optional

from slime_hydra.options import Problem, choice, non_negative, positive

ON_BAD_LINE = ("error", "skip")
"""data.on_bad_line: what data/dataset.py does with a malformed row."""
TASKS = ("addition",)
"""data.task: the built-in generated tasks, each a module of slime_hydra/data/tasks/ with that name."""


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
class DataConfig:
    name: str = "addition"
    """The conf/data option this came from."""
    path: Optional[str] = None
    """Training prompts: a .jsonl or .parquet file; null uses the built-in task (`task`)."""
    task: Optional[str] = choice("addition", TASKS)
    """Built-in generated task used when path is null (verifiable, offline): addition."""
    prompt_key: str = "prompt"
    """Row key holding the prompt: a string, or a list of chat messages."""
    label_key: str = "label"
    """Row key holding the reference answer given to the reward function."""
    metadata_key: Optional[str] = None
    """Row key holding a dict passed to the reward as metadata; null for none."""
    tools_key: Optional[str] = None
    """Row key holding tool specs passed to the chat template; null for none."""
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
        if self.row_end is not None and self.row_end <= self.row_start:
            yield Problem((f"{prefix}row_start", f"{prefix}row_end"),
                          f"row_end={self.row_end} must be after row_start={self.row_start}")
