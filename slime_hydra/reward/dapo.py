"""DAPO's rule reward: the answer after the last "Answer:", normalised, must equal the normalised label.

    dapo_reward(response, label, metadata) -> {"score": 1.0 | -1.0, "acc": bool, "pred": str}

Normalisation (both sides): strip ``$``, ``\\boxed{}`` / ``\\text{}`` wrappers, ``\\left``/``\\right``, spaces,
trailing full stops, thousands separators (``1,000`` -> ``1000``), a trailing unit word, degrees
(``^\\circ``, ``°``), and ``\\dfrac``/``\\tfrac`` -> ``\\frac``; then string equality, with numbers also compared
by value (``0.50`` == ``.5``). Use ``reward.reward_key=score`` (conf/reward/dapo.yaml does).
"""

import re
from typing import Any, Optional

from slime_hydra.reward.math import last_boxed

_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_UNIT_WORDS = ("units", "unit", "cm", "m", "km", "inches", "inch", "feet", "ft", "degrees", "degree", "dollars",
               "cents", "hours", "minutes", "seconds", "meters", "square", "sq")


def normalize(text: str) -> str:
    s = str(text).strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "").replace("\\%", "").replace("%", "")
    s = s.replace("$", "").strip().rstrip(".").strip()
    words = s.split()
    while len(words) > 1 and words[-1].lower() in _UNIT_WORDS:
        words.pop()
    s = "".join(words)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def dapo_reward(response: str, label: Any, metadata: Optional[dict] = None) -> dict:
    """{"score": +1/-1, "acc": correct, "pred": the normalised prediction ("" when no "Answer:" is found)}."""
    matches = list(_ANSWER.finditer(response))
    if not matches:
        return {"score": -1.0, "acc": False, "pred": ""}
    tail = response[matches[-1].end():].strip().splitlines()
    pred = normalize(tail[0]) if tail else ""
    correct = bool(pred) and _same(pred, normalize(label))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
