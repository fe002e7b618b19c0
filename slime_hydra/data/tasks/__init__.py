"""Built-in verifiable tasks generated offline (data.task=<name>): rows of {prompt, label} plus a held-out split."""

from slime_hydra.data.tasks import addition

TASKS = {"addition": addition}


def get_task(name: str):
    """The task module: rows(split, seed) -> list[dict], sft_rows(n, seed) -> list[dict]."""
    if name not in TASKS:
        raise ValueError(f"unknown data.task={name!r}; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name]
