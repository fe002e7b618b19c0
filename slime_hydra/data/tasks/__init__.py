"""Built-in verifiable tasks generated offline (data.task=<name>): rows of {prompt, label} plus a held-out split.

Each name in ``data/config.TASKS`` is a module here with ``rows(split, seed)`` and ``sft_rows(n, seed)``.
"""

import importlib

from slime_hydra.data.config import TASKS


def get_task(name: str):
    """The task module: rows(split, seed) -> list[dict], sft_rows(n, seed) -> list[dict]."""
    if name not in TASKS:
        raise ValueError(f"unknown data.task={name!r}; built-in tasks: {', '.join(TASKS)}")
    return importlib.import_module(f"{__name__}.{name}")
