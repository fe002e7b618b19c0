"""Warnings a run prints when its metrics say it is learning nothing, naming the key that likely fixes it.

    alerts = RunAlerts()
    for line in alerts.observe(step, metrics):   # each step's metrics, as the tracker logs them
        print(line)

Two signs, each warned once when it appears and again only after it went away and came back:

- truncation: ``rollout/truncated_ratio`` >= TRUNCATED_RATIO for TRUNCATED_STEPS steps in a row. Nearly every
  response is cut at ``rollout.max_response_tokens``, so the reward grades unfinished answers (the calculator task
  with a model's 8-token responses scored 0.000 at every step, silently).
- a constant reward: ``rollout/raw_reward`` equal (to 1e-9) for CONSTANT_STEPS steps in a row. The responses all
  score alike, so group-relative advantages are 0 and the policy gets no gradient: a reward that does not read the
  data's labels, a task far too hard or too easy for the model, or the truncation above.

Checked on the metrics rather than on the config: the config cannot know how long the model's answers are.
"""

from typing import Mapping

TRUNCATED_RATIO = 0.9
"""rollout/truncated_ratio at or above this counts as "nearly every response is cut"."""
TRUNCATED_STEPS = 3
"""Steps in a row of such truncation before the warning."""
CONSTANT_STEPS = 5
"""Steps in a row with the same mean reward before the warning."""


class RunAlerts:
    """The two warnings of the module docstring, fed one step's metrics at a time."""

    def __init__(self) -> None:
        self.truncated_steps = self.constant_steps = 0
        self.last_reward: float | None = None
        self.warned: set[str] = set()

    def observe(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """The warnings that start at this step (usually none)."""
        out = []
        ratio = metrics.get("rollout/truncated_ratio")
        if ratio is not None:
            self.truncated_steps = self.truncated_steps + 1 if ratio >= TRUNCATED_RATIO else 0
            if self._starts("truncated", self.truncated_steps >= TRUNCATED_STEPS):
                out.append(f"warning (step {step}): {ratio:.0%} of the responses were cut at "
                           f"rollout.max_response_tokens for {self.truncated_steps} steps in a row "
                           "(rollout/truncated_ratio), so the reward grades unfinished answers; raise "
                           "rollout.max_response_tokens, or check that the model ends its answers (its stop token, "
                           "the chat template: data.apply_chat_template)")
        reward = metrics.get("rollout/raw_reward")
        if reward is not None:
            same = self.last_reward is not None and abs(reward - self.last_reward) <= 1e-9
            self.constant_steps, self.last_reward = (self.constant_steps + 1 if same else 1), reward
            if self._starts("constant", self.constant_steps >= CONSTANT_STEPS):
                cause = (" (nearly every response is truncated: see rollout.max_response_tokens)"
                         if self.truncated_steps else "")
                out.append(f"warning (step {step}): rollout/raw_reward has been {reward:.3f} for {CONSTANT_STEPS} "
                           f"steps in a row{cause}: every response scores alike, so the advantages are 0 and the "
                           "policy learns nothing; check reward.name / reward.target against the data's labels "
                           "(data.label_key), and the task's difficulty for this model (data.level)")
        return out

    def _starts(self, name: str, active: bool) -> bool:
        """True when warning ``name`` becomes active now (it was inactive, or never warned)."""
        if not active:
            self.warned.discard(name)
            return False
        if name in self.warned:
            return False
        self.warned.add(name)
        return True
