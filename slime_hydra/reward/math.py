"""Math answers: extract the final answer, compare it symbolically with math-verify.

    math_reward(response, label, metadata) -> 1.0 | 0.0
    deepscaler_reward(response, label, metadata) -> 1.0 | 0.0

Extraction: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``; braces balanced, so nested ``\\frac{}{}``
works); without one, the text after the last "answer is" / "Answer:"; without that, the last number. The
extracted answer and the label are parsed by ``math_verify.parse`` (LaTeX and plain expressions: fractions,
decimals, ``\\sqrt``, percentages, units in ``\\text{}``, degrees, intervals, sets) and compared by
``math_verify.verify`` (sympy equivalence; numbers to 6 decimals).

math-verify's own timeouts use SIGALRM, which only works in the main thread; rewards run in worker threads
(reward/__init__.py), so its timeouts are off here and the scorer bounds each call instead.

``deepscaler``: the answer must come after the reasoning block: only the text after the last ``</think>`` is
graded, and a response without ``</think>`` scores 0 (DeepScaleR's rule).
"""

import logging
import re
from typing import Any, Optional

from math_verify import parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made without its timeouts

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"(?:answer\s+is|answer\s*:)\s*(.+)", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} / \\fbox{...} with balanced braces, or None."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(text: str) -> Optional[str]:
    """The final answer of a response: last boxed, else after the last "answer is"/"Answer:", else last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        answer = matches[-1].group(1).strip().splitlines()[0].strip().rstrip(".").strip()
        if answer:
            return answer
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _parse(text: str):
    wrapped = text if text.lstrip().startswith("$") else f"${text}$"
    parsed = parse(wrapped, parsing_timeout=None)
    return parsed if parsed else parse(text, parsing_timeout=None)


def equivalent(answer: str, label: Any) -> bool:
    """answer and label denote the same mathematical object (math-verify), or are the same string."""
    label_text = str(label).strip()
    if answer.strip().replace(",", "") == label_text.replace(",", ""):
        return True
    gold, pred = _parse(label_text), _parse(answer.replace(",", "") if _NUMBER.fullmatch(answer) else answer)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def math_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """1.0 when the response's final answer (see the module docstring) equals the label, else 0.0."""
    answer = extract_answer(response)
    return float(answer is not None and equivalent(answer, label))


def deepscaler_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """math_reward of the text after the last ``</think>``; 0.0 when there is no ``</think>``."""
    if "</think>" not in response:
        return 0.0
    return math_reward(response.rsplit("</think>", 1)[1], label)
