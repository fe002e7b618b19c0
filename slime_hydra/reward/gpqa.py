"""Multiple choice (GPQA, MMLU-style): the letter A-J the response finally commits to, against the label.

The choice is found by the first of these patterns that matches anywhere, taking its last match:
``\\boxed{C}`` (or ``\\boxed{(C)}``), "Answer: C" / "the answer is (C)" / "answer: **C**", a parenthesised
"(C)", and finally a lone capital letter at the very end ("... so it is C."). Letters must be capitals, so the
article in "the answer is a tricky one" is not a choice. The label is a letter ("C", "(C)") or a 0-based index
(2 -> "C"). Reward: 1.0 when the letters are equal, else 0.0 (also when no choice is found).
"""

import re
from typing import Any, Optional

LETTERS = "ABCDEFGHIJ"
_CHOICE_PATTERNS = (
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*:?\s*\(?\*{0,2}([A-J])\b"),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"\b([A-J])\W*$"),
)


def choice_letter(response: str) -> Optional[str]:
    """The letter the response finally chooses (see the module docstring), or None."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(response)
        if found:
            return found[-1]
    return None


def gpqa_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """1.0 when choice_letter(response) is the label's letter, else 0.0."""
    gold = LETTERS[label] if isinstance(label, int) else str(label).strip().strip("()").upper()
    return float(choice_letter(response) == gold)
