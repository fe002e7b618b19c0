"""Worked examples of the rollout hooks a user writes (docs/rollout.md, "Hook API reference"), templates to copy:
``answer_prefix`` is a single-turn generate hook (a prefix the policy is not trained on, per-row sampling settings);
``calculator_tool`` is a multi-turn one in which the policy calls a tool (the calculator task's,
data/tasks/calculator.py)."""
