"""n-digit arithmetic: prompt "37*12-5=", label str(value) (``data.task=arithmetic``).

The level sets the operands' digits, their count and the operators (``LEVELS``); the value follows Python's
precedence (* before + and -) and may be negative. A response is right when, stripped, it is exactly the label's
digits (as addition.py scores), so reward=math and reward=exact_match grade it too.
"""

import random
from typing import Any, Optional

from slime_hydra.data.tasks.env import Environment

LEVELS = {1: (1, 2, "+-"), 2: (2, 2, "+-"), 3: (2, 2, "+-*"), 4: (2, 3, "+-*"), 5: (3, 3, "+-*"),
          6: (3, 4, "+-*"), 7: (4, 4, "+-*"), 8: (4, 5, "+-*")}
"""Level -> (digits per operand, operands, operators)."""


def _value(operands: list[int], operators: list[str]) -> int:
    """The expression's value with * before + and -."""
    terms, signs = [operands[0]], []
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(op)
    total = terms[0]
    for sign, x in zip(signs, terms[1:]):
        total = total + x if sign == "+" else total - x
    return total


class Arithmetic(Environment):
    name = "arithmetic"
    default_level = 2
    graded_by = ("math", "exact_match")

    def problem(self, rng: random.Random, level: int) -> tuple[str, Any, dict]:
        digits, count, ops = LEVELS[level]
        operands = [rng.randrange(10 ** digits) for _ in range(count)]
        operators = [rng.choice(ops) for _ in range(count - 1)]
        text = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(operators, operands[1:]))
        return f"{text}=", str(_value(operands, operators)), {}

    def score(self, response: str, label: Any, metadata: Optional[dict] = None) -> float:
        """1.0 when the response, stripped, is exactly the label, else 0.0."""
        return float(response.strip() == str(label))

    def solution(self, label: Any, metadata: dict) -> str:
        return str(label)


TASK = Arithmetic()
