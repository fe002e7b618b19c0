"""Sorting: prompt "sort 41 7 19 =", label "7 19 41" (``data.task=sorting``).

Level L (1..10) gives L + 2 numbers drawn from 0..9 (L <= 2), 0..99 (L <= 6) or 0..999; repeats allowed. A response
is right when its numbers, separated by white space, are the given ones in ascending order (reward=exact_match grades
it too when the response is written with single spaces).
"""

import random
from typing import Any, Optional

from slime_hydra.data.tasks.env import Environment


def value_range(level: int) -> int:
    """Largest value drawn at ``level``."""
    return 9 if level <= 2 else 99 if level <= 6 else 999


class Sorting(Environment):
    name = "sorting"
    default_level = 3
    graded_by = ("exact_match",)

    def problem(self, rng: random.Random, level: int) -> tuple[str, Any, dict]:
        values = [rng.randint(0, value_range(level)) for _ in range(level + 2)]
        return f"sort {' '.join(map(str, values))} =", " ".join(map(str, sorted(values))), {"values": values}

    def score(self, response: str, label: Any, metadata: Optional[dict] = None) -> float:
        """1.0 when the response's white-space separated items are the label's, else 0.0."""
        return float(response.split() == str(label).split())

    def solution(self, label: Any, metadata: dict) -> str:
        return str(label)


TASK = Sorting()
