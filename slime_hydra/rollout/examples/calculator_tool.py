"""A worked multi-turn generate hook: the policy calls a calculator tool (``rollout.generate=
slime_hydra.rollout.examples.calculator_tool.calculator_generate``; the calculator task names it as its hook).

The model writes a call as ``<calc>12*(3+4)</calc>``. Generation runs with ``</calc>`` as an extra SGLang ``stop``
string, so the engine returns as soon as a call is closed; the hook evaluates the expression (``evaluate``, a
bounded AST evaluator: no ``eval``), appends ``<result>84</result>`` as tokens, and generates again from
prompt + everything so far. It repeats until the model ends (EOS or one of the user's stop strings), the response
budget is spent, or a call arrives after ``max_turns`` answered ones (that call stays unanswered and ends the
sample). Token layout of one sample::

    tokens            = prompt | turn 1 (model) | <result>..</result> (tool) | turn 2 (model) | ...
    loss_mask         =          1 1 ... 1        0 0 ... 0                    1 1 ... 1
    rollout_log_probs =          engine's         0.0 (not sampled)            engine's

``response_length`` counts model and tool tokens (the tool's count against ``max_new_tokens`` too), ``response``
is the decoded response (tool results included, so the reward sees them), ``metadata["tool_calls"]`` the calls
answered and ``metadata["tool_errors"]`` those answered with an error (logged as ``rollout/metadata/tool_calls``
and ``tool_errors``, beside ``rollout/masked_tokens``). Status: from the last finish reason (``stop`` -> completed,
``length`` -> truncated, ``abort`` -> aborted); truncated whenever the budget (or the context) is spent, including
when a tool result does not fit (it is then left out). An aborted sample keeps its turns and ``tool_calls``, so a
recycled partial rollout resumes where it stopped.

The tool's message is data, never an exception: a malformed or too large expression gives
``<result>error: ...</result>`` and the model carries on.
"""

import ast
import operator
from dataclasses import dataclass
from typing import Union

from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.rollout.generate import RolloutContext, apply_output

from slime_hydra.data.tasks.calculator import CALL_CLOSE, CALL_OPEN, RESULT_CLOSE, RESULT_OPEN

Number = Union[int, float]


class ToolError(ValueError):
    """An expression the calculator refuses; the message becomes the tool's answer."""


@dataclass(frozen=True)
class Limits:
    """Bounds that keep one evaluation cheap (microseconds) whatever the policy writes."""

    max_chars: int = 200
    """Longest expression accepted, in characters."""
    max_nodes: int = 64
    """Most AST nodes (numbers + operators) in one expression."""
    max_exponent: int = 64
    """Largest |exponent| of ``**``."""
    max_magnitude: float = 1e18
    """Largest |value| of any intermediate result."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str, limits: Limits = Limits()) -> Number:
    """The value of an arithmetic expression: int/float literals, + - * / // % **, parentheses, unary - and +.

    ToolError (with a short reason) for anything else: names, calls, attributes, other operators, division by
    zero, an expression longer than limits.max_chars or with more than limits.max_nodes nodes, an exponent beyond
    limits.max_exponent, or an intermediate value beyond limits.max_magnitude.
    """
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > limits.max_chars:
        raise ToolError(f"expression longer than {limits.max_chars} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as error:
        raise ToolError(f"not an arithmetic expression ({getattr(error, 'msg', error)})") from None
    if sum(1 for _ in ast.walk(tree)) - 1 > limits.max_nodes:
        raise ToolError(f"expression has more than {limits.max_nodes} terms")
    return _value(tree.body, limits)


def _value(node: ast.AST, limits: Limits) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value, limits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, limits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, limits), _value(node.right, limits)
        if isinstance(node.op, ast.Pow) and abs(right) > limits.max_exponent:
            raise ToolError(f"exponent {right} beyond {limits.max_exponent}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result beyond {limits.max_magnitude:g}") from None
        if isinstance(result, complex):
            raise ToolError("complex result (negative number to a fractional power)")
        return _bounded(result, limits)
    if isinstance(node, ast.Constant):
        raise ToolError(f"unsupported constant {node.value!r}")
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise ToolError(f"unsupported operator {type(node.op).__name__}")
    raise ToolError(f"unsupported element {type(node).__name__}")


def _bounded(value: Number, limits: Limits) -> Number:
    if value != value or abs(value) > limits.max_magnitude:  # NaN, inf, or too large
        raise ToolError(f"result beyond {limits.max_magnitude:g}")
    return value


def format_number(value: Number) -> str:
    """Integers as written; floats with up to 12 significant digits, integral ones without a fraction (3.0 -> 3)."""
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def run_calculator(expression: str, limits: Limits = Limits()) -> str:
    """The tool's answer text: the value, or ``error: <reason>``; never raises."""
    try:
        return format_number(evaluate(expression, limits))
    except ToolError as error:
        return f"error: {error}"


@dataclass(frozen=True)
class CalculatorGenerate:
    """The calculator hook (see the module docstring); an instance is the ``async generate(ctx, sample, params)``.

    A different limit is one line in the user's module: ``my_generate = CalculatorGenerate(max_turns=2)``, then
    ``rollout.generate=my_module.my_generate``.
    """

    max_turns: int = 4
    """Tool calls answered per sample; a further call ends the sample unanswered."""
    limits: Limits = Limits()
    """Bounds of one evaluation."""

    async def __call__(self, ctx: RolloutContext, sample: Sample, params: dict) -> Sample:
        stops = params.get("stop") or []
        turn_params = {**params, "stop": ([stops] if isinstance(stops, str) else list(stops)) + [CALL_CLOSE]}
        prompt_length = sample.prompt_length
        calls, errors = int(sample.metadata.get("tool_calls", 0)), int(sample.metadata.get("tool_errors", 0))
        while True:
            budget = min(params["max_new_tokens"] - sample.response_length,
                         ctx.max_context_tokens - len(sample.tokens))
            if budget <= 0:
                sample.status = Status.TRUNCATED
                break
            out = await ctx.client.generate(sample.tokens, {**turn_params, "max_new_tokens": budget},
                                            return_logprob=True)
            apply_output(sample, out)
            text = ctx.tokenizer.decode(sample.tokens[prompt_length:], skip_special_tokens=True)
            finish = out["meta_info"].get("finish_reason") or {}
            if sample.status is not Status.COMPLETED or finish.get("matched") != CALL_CLOSE:
                break  # EOS / the user's stop string, budget, abort
            if calls >= self.max_turns:
                break
            closed = text.rfind(CALL_CLOSE)
            opened = text.rfind(CALL_OPEN, 0, closed)
            if opened >= 0:
                answer = run_calculator(text[opened + len(CALL_OPEN):closed], self.limits)
            else:
                answer = f"error: no {CALL_OPEN} before {CALL_CLOSE}"
            tool_ids = ctx.tokenizer.encode(f"{RESULT_OPEN}{answer}{RESULT_CLOSE}", add_special_tokens=False)
            room = min(params["max_new_tokens"] - sample.response_length, ctx.max_context_tokens - len(sample.tokens))
            if len(tool_ids) > room:
                sample.status = Status.TRUNCATED
                break
            calls += 1
            errors += answer.startswith("error:")
            sample.tokens = sample.tokens + tool_ids
            sample.response_length += len(tool_ids)
            sample.loss_mask = sample.loss_mask + [0] * len(tool_ids)
            sample.rollout_log_probs = sample.rollout_log_probs + [0.0] * len(tool_ids)
        sample.response = ctx.tokenizer.decode(sample.tokens[prompt_length:], skip_special_tokens=True)
        sample.metadata["tool_calls"], sample.metadata["tool_errors"] = calls, errors  # rollout/metadata/tool_*
        return sample


calculator_generate = CalculatorGenerate()
"""The hook ``rollout.generate=slime_hydra.rollout.examples.calculator_tool.calculator_generate`` names
(max_turns 4)."""
