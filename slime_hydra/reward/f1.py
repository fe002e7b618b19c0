"""SQuAD-style token F1 between the response and one or several reference answers.

Both sides are lower-cased, punctuation and the articles a/an/the removed, then split on whitespace. With
``common`` the tokens shared by both (counted with multiplicity), P = common / predicted tokens and
R = common / reference tokens:

    F1 = 2 * P * R / (P + R)        (0 when nothing is common)

and the reward is the maximum F1 over the references when the label is a list.
"""

import re
import string
from collections import Counter
from typing import Any, Optional

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", str(text).lower().translate(_PUNCT)).split()


def token_f1(prediction: str, reference: str) -> float:
    """F1 of one prediction against one reference (the formula in the module docstring)."""
    pred, ref = _tokens(prediction), _tokens(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


def f1_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """max over references of token_f1(response, reference); label is one reference or a list of them."""
    references = label if isinstance(label, (list, tuple)) else [label]
    return max((token_f1(response, str(ref)) for ref in references), default=0.0)
