"""The rollout batches that ``debug.save_rollouts`` writes (``<run_dir>/rollouts/step_NNNNNN.jsonl``, one Sample
dict a line) and ``debug=train_only`` trains from (``debug.rollout_path``)."""

import json
from pathlib import Path

from slime_hydra.buffer.sample import Sample


def save_rollout(out_dir: Path, step: int, samples: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"step_{step:06d}.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")


def load_saved_rollout(rollout_dir: Path, step: int) -> list[Sample]:
    """Samples saved by debug.save_rollouts for this step (cycling when the run saved fewer steps)."""
    files = sorted(rollout_dir.glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"debug.rollout_path={rollout_dir}: no step_*.jsonl files (write them with a "
                                "debug=rollout_only run)")
    path = files[step % len(files)]
    return [Sample.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line]
