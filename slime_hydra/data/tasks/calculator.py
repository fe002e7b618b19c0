"""A multi-turn tool task: arithmetic too long to do in one's head, with the calculator tool (``data.task=
calculator``; its prompts need the tool-calling generate hook ``GENERATE_HOOK``, which validation asks for).

Prompt "Compute 4821*397+12 with <calc></calc>:", label "1913949". The hook (rollout/examples/calculator_tool.py)
answers each
``<calc>expression</calc>`` the model writes with ``<result>value</result>`` and lets it go on; the answer is what the
model writes after the last tool result (the whole response when it made no call), stripped, and it is right when it
is exactly the label's digits. A correct response, as the warm start teaches it:
``<calc>4821*397+12</calc><result>1913949</result>1913949``.

The level sets the operands' digits, their count and the operators (``LEVELS``), as in arithmetic.py.
"""

import random
from typing import Any, Optional

from slime_hydra.data.tasks.arithmetic import _value
from slime_hydra.data.tasks.env import Environment

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
"""How the model writes a call of the calculator tool."""
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
"""How the tool answers (the generate hook writes them; the score reads the answer after the last one)."""
GENERATE_HOOK = "slime_hydra.rollout.examples.calculator_tool.calculator_generate"
"""The rollout.generate hook that runs the tool (the task's ``generate_hook``)."""
LEVELS = {1: (2, 2, "+-*"), 2: (3, 2, "*"), 3: (3, 3, "+-*"), 4: (4, 3, "+-*"), 5: (5, 3, "+-*"), 6: (6, 4, "+-*")}
"""Level -> (digits per operand, operands, operators)."""


def final_answer(response: str) -> str:
    """What the response says after its last tool result, stripped."""
    return response.rsplit(RESULT_CLOSE, 1)[-1].strip()


class Calculator(Environment):
    name = "calculator"
    default_level = 2
    generate_hook = GENERATE_HOOK

    def problem(self, rng: random.Random, level: int) -> tuple[str, Any, dict]:
        digits, count, ops = LEVELS[level]
        operands = [rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(count)]
        operators = [rng.choice(ops) for _ in range(count - 1)]
        expression = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(operators, operands[1:]))
        return (f"Compute {expression} with <calc></calc>:", str(_value(operands, operators)),
                {"expression": expression})

    def score(self, response: str, label: Any, metadata: Optional[dict] = None) -> float:
        """1.0 when the answer after the last tool result is exactly the label, else 0.0."""
        return float(final_answer(response) == str(label))

    def solution(self, label: Any, metadata: dict) -> str:
        return f"{CALL_OPEN}{metadata['expression']}{CALL_CLOSE}{RESULT_OPEN}{label}{RESULT_CLOSE}{label}"


TASK = Calculator()
