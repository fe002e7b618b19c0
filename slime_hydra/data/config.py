"""Data group schema: where prompts come from and how they become token ids."""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class EvalDataConfig:
    name: str = "eval"
    """Name used in metric keys: eval/<name>/accuracy, eval/<name>/pass@k."""
    path: Optional[str] = None
    """JSONL or Parquet file of eval prompts; null uses the task's held-out split (built-in tasks only)."""
    n_samples_per_prompt: int = 1
    """Responses per eval prompt (pass@k needs k <= this)."""
    temperature: float = 0.0
    """Eval sampling temperature; 0 is greedy."""
    max_response_tokens: Optional[int] = None
    """Eval response budget in tokens; null means rollout.max_response_tokens."""
    max_prompts: Optional[int] = None
    """Evaluate only the first N prompts; null means all."""


@dataclass
class DataConfig:
    name: str = "addition"
    """The conf/data option this came from."""
    path: Optional[str] = None
    """Training prompts: a .jsonl or .parquet file; null uses the built-in task (`task`)."""
    task: Optional[str] = "addition"
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
    max_prompt_tokens: int = 1024
    """Prompts longer than this many tokens are filtered out (and counted) when the dataset loads."""
    row_start: int = 0
    """First row used (0-based, inclusive)."""
    row_end: Optional[int] = None
    """Row after the last one used (exclusive); null means to the end."""
    shuffle: bool = True
    """Shuffle prompts every epoch with a permutation derived from (seed, epoch)."""
    seed: int = 1234
    """Shuffle seed."""
    on_bad_line: str = "error"
    """error: stop at a malformed row naming file and line | skip: skip it and count it."""
    eval: List[EvalDataConfig] = field(default_factory=list)
    """Eval datasets, each with its own sampling settings."""
