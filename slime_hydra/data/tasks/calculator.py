"""A multi-turn tool task: arithmetic too long to do in one's head, with the calculator tool (``data.task=
calculator``; needs ``rollout.generate=slime_hydra.rollout.tools.calculator_generate``).

Prompt "Compute 4821*397+12 with <calc></calc>:", label "1913949". The hook (rollout/tools.py) answers each
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

RESULT_CLOSE = "</result>"
"""How the calculator tool ends its answer (rollout/tools.RESULT_CLOSE; a test checks they agree)."""
LEVELS = {1: (2, 2, "+-*"), 2: (3, 2, "*"), 3: (3, 3, "+-*"), 4: (4, 3, "+-*"), 5: (5, 3, "+-*"), 6: (6, 4, "+-*")}
"""Level -> (digits per operand, operands, operators)."""


def final_answer(response: str) -> str:
    """What the response says after its last tool result, stripped."""
    return response.rsplit(RESULT_CLOSE, 1)[-1].strip()


class Calculator(Environment):
    name = "calculator"
    default_level = 2

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
        return f"<calc>{metadata['expression']}</calc><result>{label}{RESULT_CLOSE}{label}"


TASK = Calculator()
