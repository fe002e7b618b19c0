"""``AdaptiveSampler``: training prompts generated on the fly, each task at the level that keeps its pass rate in
a target band (``data.adaptive``).

Prompts. The k-th prompt handed out (k counts from 0 over the whole run) is task ``tasks[k % len(tasks)]`` at that
task's current level, drawn by ``Environment.draw(seed, k, level)``: a function of (seed, k, level) alone. The
state is therefore the counter k, each task's level and each task's window of recent pass rates; a sampler restored
from ``state_dict()`` hands out exactly the prompts the uninterrupted one would have.

Levels. The rollout reports every scored group (``update``): its task, the level its prompt was drawn at, and its
pass rate (fraction of its samples correct), in group order, once per batch, so the levels change only between
batches. A group drawn at a level that is no longer its task's current one is not counted. The window holds the
last ``window_groups`` pass rates at the current level; when it is full and its mean is above ``band_high`` the
level goes up one, below ``band_low`` down one (within [min_level, max_level]), and the window is emptied so the new
level is judged on its own groups; otherwise the window slides (the oldest rate leaves as the next one comes).

Metrics (``update`` returns them, for the step): ``env/<task>/level`` (after the update), ``env/<task>/pass_rate``
(this batch's groups), ``env/<task>/window_pass_rate``, ``env/<task>/groups`` and, per level seen in the batch,
``env/<task>/level_<L>/pass_rate``.
"""

import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

from slime_hydra.data.config import AdaptiveConfig
from slime_hydra.data.tasks import get_env


@dataclass
class TaskLevel:
    """One task's place: its level and the pass rates counted at it."""

    level: int
    low: int
    """Lowest level of this task (data.adaptive.min_level)."""
    high: int
    """Highest level of this task (data.adaptive.max_level, at most the task's own)."""
    window: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class GroupResult:
    """What the rollout reports of one scored group."""

    task: str
    level: int
    pass_rate: float


class AdaptiveSampler:
    """Prompts from environments at adaptive levels (see the module docstring); ``take`` as PromptSource's."""

    def __init__(self, cfg: AdaptiveConfig, task: str, seed: int, make_records: Callable[[list[dict]], list]):
        """cfg: data.adaptive; task: data.task (the one task when cfg.tasks is empty); seed: data.seed;
        make_records: rows {"prompt", "label", "metadata"} -> records (tokenized PromptRecords), one per row."""
        self.cfg = cfg
        self.tasks = list(cfg.tasks) or [task]
        self.envs = {name: get_env(name) for name in self.tasks}
        self.seed = seed
        self.make_records = make_records
        self.drawn = 0
        """Prompts handed out since the start."""
        self.places: dict[str, TaskLevel] = {}
        for name, env in self.envs.items():
            high = min(env.max_level, cfg.max_level or env.max_level)
            start = min(max(cfg.start_level or cfg.min_level, cfg.min_level), high)
            self.places[name] = TaskLevel(start, cfg.min_level, high)

    def level(self, task: str) -> int:
        return self.places[task].level

    def rows(self, n: int) -> list[dict]:
        """The next n rows (advances the counter)."""
        out = []
        for _ in range(n):
            task = self.tasks[self.drawn % len(self.tasks)]
            out.append(self.envs[task].draw(self.seed, self.drawn, self.places[task].level))
            self.drawn += 1
        return out

    def take(self, n: int) -> list:
        """The next n prompts as records."""
        records = self.make_records(self.rows(n))
        if len(records) != n:
            raise ValueError(f"{n - len(records)} of {n} generated prompts were dropped (longer than "
                             "data.max_prompt_tokens?); raise data.max_prompt_tokens or lower data.adaptive.max_level")
        return records

    def update(self, results: Sequence[GroupResult]) -> dict[str, float]:
        """Count the scored groups (in group order) and move levels; returns this batch's env/ metrics."""
        metrics: dict[str, float] = {}
        for name in self.tasks:
            mine = [r for r in results if r.task == name]
            place = self.places[name]
            for r in mine:
                if r.level != place.level:
                    continue
                place.window = (place.window + [r.pass_rate])[-self.cfg.window_groups:]
                if len(place.window) < self.cfg.window_groups:
                    continue
                rate = statistics.fmean(place.window)
                if rate > self.cfg.band_high and place.level < place.high:
                    place.level, place.window = place.level + 1, []
                elif rate < self.cfg.band_low and place.level > place.low:
                    place.level, place.window = place.level - 1, []
            metrics[f"env/{name}/level"] = float(place.level)
            metrics[f"env/{name}/groups"] = float(len(mine))
            if place.window:
                metrics[f"env/{name}/window_pass_rate"] = statistics.fmean(place.window)
            if mine:
                metrics[f"env/{name}/pass_rate"] = statistics.fmean(r.pass_rate for r in mine)
            for level in sorted({r.level for r in mine}):
                metrics[f"env/{name}/level_{level}/pass_rate"] = statistics.fmean(
                    r.pass_rate for r in mine if r.level == level)
        return metrics

    def state_dict(self) -> dict:
        """JSON-safe: the counter, each task's level and window; seed and tasks to check the resume."""
        return {"kind": "adaptive", "drawn": self.drawn, "seed": self.seed, "tasks": list(self.tasks),
                "levels": {n: p.level for n, p in self.places.items()},
                "windows": {n: list(p.window) for n, p in self.places.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; ValueError if it is not an adaptive sampler's or its seed or tasks differ."""
        if state.get("kind") != "adaptive":
            raise ValueError("the checkpoint's prompt cursor is a dataset's, but data.adaptive.enabled=true; resume "
                             "with the run's own data settings")
        mismatched = [f"{key}: saved {state[key]!r}, now {now!r}" for key, now in
                      (("seed", self.seed), ("tasks", self.tasks)) if state[key] != now]
        if mismatched:
            raise ValueError("the adaptive sampler's state does not match this config: " + "; ".join(mismatched))
        self.drawn = int(state["drawn"])
        for name, place in self.places.items():
            place.level = min(max(int(state["levels"][name]), place.low), place.high)
            place.window = [float(x) for x in state["windows"][name]]
