"""Checks that read the filesystem: the checkpoint and dataset paths a run will open, and the folder it writes.

Kept apart from config/rules.py because recipes name shared-storage paths that exist only on the cluster: a dry
run of a SLURM config reports these as warnings, a real run (or a submission, from a login node that sees shared
storage), or any launch on this machine, refuses. When ``model.path`` holds a ``config.json``, its architecture
must match the chosen model option, since validation reasoned with the option's numbers. ``output_dir`` must be a
directory this process can create files in (or one it can create): a file is made there and removed, because
permission bits do not say what a read-only mount or root squashing on shared storage refuses.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Iterator

from slime_hydra.options import Problem
from slime_hydra.config.datasets import dataset_files
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
            try:
                hf = json.loads((path / "config.json").read_text())
                if not isinstance(hf, dict) or not isinstance(hf.get("text_config", {}), dict):
                    raise ValueError(f"a JSON object with a text_config object is expected, got {type(hf).__name__}")
            except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                yield Problem(("model.path",), f"{path}/config.json cannot be read: {type(error).__name__}: {error}",
                              "point model.path at an intact HF checkpoint dir")
            else:
                yield from _compare_architecture(cfg, hf)
                yield from _checkpoint_parts(path)
    for key, value, _, _ in dataset_files(cfg):
        if not Path(value).is_file():
            yield Problem((key,), f"{value} does not exist", f"set {key} to an existing .jsonl or .parquet file")
    yield from _check_output_dir(cfg.output_dir)


WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json")
"""Files of which an HF checkpoint holds at least one: its weights."""
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which an HF checkpoint holds at least one: its tokenizer (the rollout and the data read it)."""


def _checkpoint_parts(path: Path) -> Iterator[Problem]:
    """The weights and a tokenizer are there, and the tokenizer loads as the run will load it."""
    if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        yield Problem(("model.path",), f"{path} has a config.json but no weights ({', '.join(WEIGHTS)})",
                      "point model.path at a complete HF checkpoint (huggingface-cli download <repo> --local-dir ...)")
    if not any((path / name).is_file() for name in TOKENIZER):
        yield Problem(("model.path",), f"{path} has no tokenizer (none of {', '.join(TOKENIZER)})",
                      "copy the model's tokenizer files into it")
        return
    from slime_hydra.model.hf import load_tokenizer  # transformers: ~2 s to import, only for a checkpoint here

    try:
        load_tokenizer(path)
    except Exception as error:  # a damaged file of any of the formats AutoTokenizer reads
        yield Problem(("model.path",), f"the tokenizer at {path} does not load: {type(error).__name__}: "
                      f"{str(error)[:300]}", "point model.path at an intact HF checkpoint dir")


def _check_output_dir(output_dir: str) -> Iterator[Problem]:
    """output_dir is (or can become) a folder a file can be created in; the folders it would create are not made."""
    path = Path(output_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    fix = "set output_dir to a writable directory (e.g. output_dir=$HOME/runs)"
    if not existing.is_dir():
        yield Problem(("output_dir",), f"{existing} is a file, not a directory, so {path} cannot be made", fix)
        return
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".slime_hydra_probe_")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        yield Problem(("output_dir",), f"{existing} cannot hold a new file ({error.strerror})"
                      + (f", so {path} cannot be made" if existing != path else ""), fix)


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
