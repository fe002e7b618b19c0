"""Text rewards: SQuAD token F1, multiple-choice letters, exact match, and a random reward for debugging.

``f1``: both sides lower-cased, punctuation and the articles a/an/the removed, split on whitespace; with p =
common / predicted tokens and r = common / reference tokens (common counted with multiplicity), F1 = 2pr / (p + r)
(0 when nothing is common); the maximum over the references when the label is a list.

``gpqa``: the last choice letter A-J the response commits to ("Answer: C", "answer is (C)", "\\boxed{C}", "(C)" or a
lone capital letter at the end); 1.0 when it equals the label (a letter, or a 0-based index).

``exact_match``: stripped strings equal. ``random``: 0 or 1 with probability 1/2 from a generator seeded by
metadata["seed"] (default 0) and the response text, so the same input gives the same reward.
"""

import random
import re
import string
import zlib
from collections import Counter
from typing import Any, Optional

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split()


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = _tokens(prediction), _tokens(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


def f1_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    references = label if isinstance(label, (list, tuple)) else [label]
    return max(token_f1(response, str(ref)) for ref in references)


_CHOICE_PATTERNS = (
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    re.compile(r"answer\s*(?:is|:)?\s*:?\s*\(?\*{0,2}([A-J])\b", re.IGNORECASE),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"\b([A-J])\W*$"),
)


def choice_letter(response: str) -> Optional[str]:
    """The letter the response finally chooses, by the first pattern (in the order above) that matches."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(response)
        if found:
            return found[-1].upper()
    return None


def gpqa_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    gold = "ABCDEFGHIJ"[label] if isinstance(label, int) else str(label).strip().strip("()").upper()
    return float(choice_letter(response) == gold)


def exact_match_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    return float(response.strip() == str(label).strip())


def random_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    seed = (metadata or {}).get("seed", 0)
    return float(random.Random(zlib.crc32(f"{seed}:{response}".encode())).random() < 0.5)
