"""Worked examples of the rollout hooks a user writes (docs/rollout.md): ``calculator_tool`` is a multi-turn
generate hook in which the policy calls a tool (the calculator task's, data/tasks/calculator.py)."""
