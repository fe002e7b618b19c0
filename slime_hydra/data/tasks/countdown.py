"""Countdown: reach a target from given numbers with + - * / (``data.task=countdown``; reward=task).

Prompt "Make 71 from 3 7 25 2 using + - * /:", label "71", metadata {"numbers": [3, 7, 25, 2], "target": 71,
"solution": one expression that reaches it}. Many answers are right: a response is checked by evaluating it
(``value``), never by comparing it with a stored answer. The answer is the response's last non-empty line, up to
an "=" if it has one ("(25-7)*3+2=56" is read as "(25-7)*3+2").

The checker parses with ``ast`` and walks the tree itself (no ``eval``): only integer literals, the binary operators
+ - * / and parentheses are allowed (no unary minus, names, calls, attributes, floats or other operators), each
literal must be one of the given numbers and uses it up (a number given twice may be used twice), and arithmetic
is exact (``fractions.Fraction``: 7/2*2 is 7). Division by zero, an empty answer or one longer than
``MAX_CHARS`` is wrong.

Level L (1..5) gives L + 1 numbers drawn from 1..10*L; the target is the value of a random expression that uses all
of them (a positive integer up to ``MAX_TARGET``), so every problem has a solution.
"""

import ast
import operator
import random
from collections import Counter
from fractions import Fraction
from typing import Any, Optional, Sequence

from slime_hydra.data.tasks.env import Environment

MAX_CHARS = 200
"""Longest answer checked, in characters (bounds the parse)."""
MAX_TARGET = 999
"""Largest target generated."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class InvalidExpression(ValueError):
    """An answer the checker refuses; the message says why."""


def value(expression: str, numbers: Sequence[int]) -> Fraction:
    """The exact value of ``expression`` built from ``numbers`` (each at most as often as given) with + - * /.

    InvalidExpression for anything else (see the module docstring)."""
    text = expression.strip()
    if not text:
        raise InvalidExpression("empty expression")
    if len(text) > MAX_CHARS:
        raise InvalidExpression(f"longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as error:
        raise InvalidExpression(f"not an expression ({getattr(error, 'msg', error)})") from None
    left = Counter(numbers)

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if left[node.value] == 0:
                raise InvalidExpression(f"{node.value} is not a given number, or is used more often than given")
            left[node.value] -= 1
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise InvalidExpression("division by zero")
            return _OPS[type(node.op)](a, b)
        raise InvalidExpression(f"{type(node).__name__} is not allowed: only numbers, + - * / and parentheses")

    return walk(tree.body)


def answer_of(response: str) -> str:
    """The expression a response answers with: its last non-empty line, up to the first "="."""
    lines = [line for line in response.strip().splitlines() if line.strip()]
    return lines[-1].split("=", 1)[0] if lines else ""


def check(expression: str, numbers: Sequence[int], target: int) -> bool:
    """The expression is valid (``value``) and equals target exactly."""
    try:
        return value(expression, numbers) == target
    except InvalidExpression:
        return False


class Countdown(Environment):
    name = "countdown"
    default_level = 2

    def problem(self, rng: random.Random, level: int) -> tuple[str, Any, dict]:
        while True:
            numbers = [rng.randint(1, 10 * level) for _ in range(level + 1)]
            terms = [(Fraction(n), str(n)) for n in numbers]
            while len(terms) > 1:
                a = terms.pop(rng.randrange(len(terms)))
                b = terms.pop(rng.randrange(len(terms)))
                op = rng.choice(list(_OPS))
                if op is ast.Div and b[0] == 0:
                    op = ast.Add
                terms.append((_OPS[op](a[0], b[0]), f"({a[1]}{_SYMBOLS[op]}{b[1]})"))
            target, solution = terms[0]
            if target.denominator == 1 and 1 <= target <= MAX_TARGET:
                break
        target = int(target)
        prompt = f"Make {target} from {' '.join(map(str, numbers))} using + - * /:"
        return prompt, str(target), {"numbers": numbers, "target": target, "solution": solution[1:-1]}

    def score(self, response: str, label: Any, metadata: Optional[dict] = None) -> float:
        """1.0 when the answer (``answer_of``) is a valid expression of metadata["numbers"] equal to the label."""
        return float(check(answer_of(response), (metadata or {}).get("numbers", ()), int(label)))

    def solution(self, label: Any, metadata: dict) -> str:
        return metadata["solution"]


TASK = Countdown()
