"""A random reward for debugging the pipeline: 0.0 or 1.0, each with probability 1/2.

The generator is seeded by ``metadata["seed"]`` (default 0) and the response text, so the same response with
the same seed always gets the same reward, and a batch of different responses averages about 0.5.
"""

import random
import zlib
from typing import Any, Optional


def random_reward(response: str, label: Any, metadata: Optional[dict] = None) -> float:
    """1.0 if Random(crc32(f"{seed}:{response}")).random() < 0.5 else 0.0."""
    seed = (metadata or {}).get("seed", 0)
    return float(random.Random(zlib.crc32(f"{seed}:{response}".encode())).random() < 0.5)
