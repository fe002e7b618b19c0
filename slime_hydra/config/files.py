"""Checks that read the filesystem: the checkpoint and dataset paths a run will open.

Kept apart from config/rules.py because recipes name shared-storage paths that exist only on the cluster: a dry
run reports these as warnings, a real run (or a submission, from a login node that sees shared storage) refuses.
When ``model.path`` holds a ``config.json``, its architecture must match the chosen model option, since
validation reasoned with the option's numbers.
"""

import json
from pathlib import Path
from typing import Iterator

from slime_hydra.options import Problem
from slime_hydra.config.schema import SlimeConfig

NOT_COMPARED = ("tie_word_embeddings", "rope_theta")
"""Fields the model options do not pin to their checkpoint's values (they only shape random-init builds)."""


def check_files(cfg: SlimeConfig) -> Iterator[Problem]:
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not path.is_dir():
            yield Problem(("model.path",), f"{path} is not a directory", "point model.path at an HF checkpoint dir")
        elif not (path / "config.json").is_file():
            yield Problem(("model.path",), f"{path} has no config.json", "point model.path at an HF checkpoint dir")
        else:
            yield from _compare_architecture(cfg, json.loads((path / "config.json").read_text()))
    datasets = [("data.path", cfg.data.path)] + [(f"data.eval.{i}.path", e.path) for i, e in enumerate(cfg.data.eval)]
    for key, value in datasets:
        if value is not None and not Path(value).is_file():
            yield Problem((key,), f"{value} does not exist", f"set {key} to an existing .jsonl or .parquet file")


def _compare_architecture(cfg: SlimeConfig, hf: dict) -> Iterator[Problem]:
    """Every field the family's record maps to config.json (model/families.py, the mapping model/hf.py writes
    configs with) against the checkpoint's value; a field the option leaves unset (or 0), or the checkpoint lacks,
    is not compared, nor are ``NOT_COMPARED``."""
    hf = {**hf.get("text_config", {}), **hf}
    family = cfg.model.spec
    for field in family.fields:
        ours = getattr(cfg.model, field)
        theirs = next((hf[k] for k in family.config_json_keys(field) if k in hf), None)
        if theirs is None or not ours or field in NOT_COMPARED:
            continue
        if ours != theirs:
            yield Problem((f"model.{field}",),
                          f"model={cfg.model.name} says {field}={ours} but {cfg.model.path}/config.json says {theirs}",
                          "choose the model option of this checkpoint (or override the field)")
