"""Exact match: 1.0 when the response and the label are the same string after stripping whitespace, else 0.0."""

from typing import Any, Optional


def exact_match_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """float(response.strip() == str(label).strip())."""
    return float(response.strip() == str(label).strip())
