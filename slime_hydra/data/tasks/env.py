"""``Environment``: a task that generates problems at a difficulty level from a seed and scores responses.

An environment (``data.task=<name>`` for a name in ``data/config.MAX_LEVELS``) writes one problem at a time::

    prompt, label, metadata = env.problem(rng, level)        # rng: a random.Random; level: 1..env.max_level
    env.score(response, label, metadata) -> 1.0 | 0.0        # the reward lives with the task (reward=task)

and the base class turns that into what the data path needs: ``rows(split, seed, levels)`` (a fixed set of rows,
{"prompt", "label", "metadata"}, the shape a JSONL dataset gives), ``draw(seed, index, level)`` (the adaptive
sampler's k-th prompt, a function of (seed, index, level) alone, so a restored cursor draws the same prompts) and
``sft_rows(n, seed)`` (prompt + a correct response, for the tiny model's warm start). Every row's metadata holds
``task`` and ``level``; ``reward=task`` reads ``task`` to find the scorer.

Held-out split: a problem is held out when the SHA-256 of "<task>/<prompt>" is 7 modulo 10 (about 10% of the
problems at every level); the train split and the sampler draw only the others, eval only those, so the two never
share a problem whatever the seed or level.
"""

import hashlib
import random
from typing import Any, Optional, Sequence

from slime_hydra.data.config import MAX_LEVELS

HELD_OUT_MOD, HELD_OUT_REST = 10, 7
TRAIN_ROWS = 10_000
"""Rows of a fixed train split (data.task=<environment> without adaptive difficulty)."""
EVAL_ROWS_PER_LEVEL = 256
"""Rows of the held-out split per level (data.eval.<i>.max_prompts keeps the first ones, levels round robin)."""
MAX_TRIES = 10_000
"""Draws tried before a split is declared empty at a level (no held-out problem there)."""
NEW_EVAL_TRIES = 50
"""Held-out draws tried for a problem not yet in the eval rows before a small level is taken as exhausted."""


class Environment:
    """Subclasses set ``name`` and ``default_level`` and write ``problem``, ``score`` and ``solution``."""

    name: str = ""
    default_level: int = 1
    """The level of data.level=null."""
    graded_by: tuple[str, ...] = ()
    """reward.name values besides ``task`` that grade this task right (e.g. math for a numeric answer)."""
    generate_hook: Optional[str] = None
    """A multi-turn task: the rollout.generate hook its prompts need (validation refuses a run without one)."""

    @property
    def max_level(self) -> int:
        return MAX_LEVELS[self.name]

    def problem(self, rng: random.Random, level: int) -> tuple[str, Any, dict]:
        """One problem at ``level``: (prompt, label, metadata), from ``rng`` alone."""
        raise NotImplementedError

    def score(self, response: str, label: Any, metadata: Optional[dict] = None) -> float:
        """1.0 when ``response`` solves the problem, else 0.0."""
        raise NotImplementedError

    def solution(self, label: Any, metadata: dict) -> str:
        """A correct response (the SFT warm start's target)."""
        raise NotImplementedError

    def held_out(self, prompt: str) -> bool:
        digest = hashlib.sha256(f"{self.name}/{prompt}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % HELD_OUT_MOD == HELD_OUT_REST

    def _row(self, rng: random.Random, level: int, split: str) -> dict:
        if not 1 <= level <= self.max_level:
            raise ValueError(f"{self.name} has levels 1..{self.max_level}, got {level}")
        for _ in range(MAX_TRIES):
            prompt, label, metadata = self.problem(rng, level)
            if self.held_out(prompt) == (split == "eval"):
                return {"prompt": prompt, "label": label, "metadata": {**metadata, "task": self.name, "level": level}}
        raise ValueError(f"{self.name}: no {split} problem at level {level} in {MAX_TRIES} draws")

    def draw(self, seed: int, index: int, level: int) -> dict:
        """The train-split row an adaptive stream hands out as its ``index``-th prompt at ``level``."""
        return self._row(random.Random(f"slime_hydra.env/{self.name}/{seed}/{index}"), level, "train")

    def rows(self, split: str = "train", seed: int = 0, levels: Optional[Sequence[int]] = None,
             n: Optional[int] = None) -> list[dict]:
        """n rows of the split (train: TRAIN_ROWS, eval: EVAL_ROWS_PER_LEVEL per level), levels round robin
        (default: [default_level]). Eval rows are distinct, so a level with few held-out problems (1-digit
        arithmetic has about 20) gives fewer, and they do not depend on ``seed``: every run evaluates the same."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, got {split!r}")
        levels = list(levels or [self.default_level])
        if n is None:
            n = TRAIN_ROWS if split == "train" else EVAL_ROWS_PER_LEVEL * len(levels)
        rng = random.Random(f"slime_hydra.env/{self.name}/{split}/{seed if split == 'train' else 0}")
        if split == "train":
            return [self._row(rng, levels[i % len(levels)], split) for i in range(n)]
        out, seen, exhausted = [], set(), set()
        for i in range(n):
            level = levels[i % len(levels)]
            for _ in range(0 if level in exhausted else NEW_EVAL_TRIES):
                row = self._row(rng, level, split)
                if row["prompt"] not in seen:
                    seen.add(row["prompt"])
                    out.append(row)
                    break
            else:
                exhausted.add(level)
        return out

    def sft_rows(self, n: int, seed: int = 0, levels: Optional[Sequence[int]] = None) -> list[dict]:
        """n train problems with a correct response, {"prompt", "response"}; levels round robin (default:
        1..default_level)."""
        rows = self.rows("train", seed, levels or range(1, self.default_level + 1), n)
        return [{"prompt": r["prompt"], "response": self.solution(r["label"], r["metadata"])} for r in rows]
