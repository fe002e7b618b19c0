"""2-digit addition: prompt "a+b=", label str(a + b), for a, b in 0..99 (10,000 problems).

The held-out split is every problem with (a * 100 + b) % 10 == 7 (1,000 problems, 10%), fixed, so train and eval
never share a problem whatever the seed. Rows are dicts {"prompt", "label", "metadata"}, the same shape a JSONL
dataset gives, so the task goes through the normal dataset path. ``sft_rows`` gives prompt + answer pairs for the
embedded default's warm start (GRPO from a random init gets no signal on this task: docs/architecture.md
"Machine facts").
"""

import random

from slime_hydra.data.tasks.env import HELD_OUT_MOD, HELD_OUT_REST


def _problems(held_out: bool) -> list[tuple[int, int]]:
    return [(a, b) for a in range(100) for b in range(100)
            if ((a * 100 + b) % HELD_OUT_MOD == HELD_OUT_REST) == held_out]


def rows(split: str = "train", seed: int = 0) -> list[dict]:
    """All problems of the split ("train": 9,000, "eval": 1,000), shuffled with seed."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    problems = _problems(held_out=split == "eval")
    random.Random(seed).shuffle(problems)
    return [{"prompt": f"{a}+{b}=", "label": str(a + b), "metadata": {"a": a, "b": b}} for a, b in problems]


def sft_rows(n: int, seed: int = 0) -> list[dict]:
    """n training problems with their answers, {"prompt", "response"}, drawn with replacement from the train split."""
    rng = random.Random(seed)
    problems = _problems(held_out=False)
    picked = [problems[rng.randrange(len(problems))] for _ in range(n)]
    return [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in picked]


def solution(label: str, metadata: dict) -> str:
    """A correct response to the problem whose answer is ``label``: the answer's digits (algo=sft's target)."""
    return label


def score(response: str, label: str) -> float:
    """1.0 when the response, stripped, is exactly the label's digits, else 0.0."""
    return float(response.strip() == label)
