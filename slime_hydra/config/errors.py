"""One validation problem names the key(s) and the fix; a ConfigError carries every problem found at once."""

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Problem:
    keys: tuple[str, ...]
    """The config keys involved, dotted (e.g. train.global_batch_samples)."""
    message: str
    """What is wrong, with the values involved."""
    fix: str = ""
    """A concrete override or edit that resolves it."""

    def __str__(self) -> str:
        text = f"[{', '.join(self.keys)}] {self.message}"
        return f"{text}; {self.fix}" if self.fix else text


class ConfigError(ValueError):
    """Raised before anything starts; lists every problem of the config."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{n} config problem{'s' if n != 1 else ''}:"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def nearest(name: str, candidates: Iterable[str]) -> Optional[str]:
    """The candidate closest to ``name`` (difflib ratio >= 0.6), or None."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return match[0] if match else None
