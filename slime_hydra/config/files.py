"""Checks that read the filesystem: the checkpoint and dataset paths a run will open, and the folder it writes.

Kept apart from config/rules.py because recipes name shared-storage paths that exist only on the cluster: a dry
run of a SLURM config reports these as warnings, a real run (or a submission, from a login node that sees shared
storage), or any launch on this machine, refuses. When ``model.path`` holds a ``config.json``, its architecture
must match the chosen model option, since validation reasoned with the option's numbers. algo=opd's teacher is
checked here too (``check_teacher``): it is a path, or an option read from a file. ``output_dir`` must be a
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
from slime_hydra.train.kinds import TRAIN_BACKEND_KINDS

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
    if cfg.algo.distills and cfg.algo.teacher.path is not None:
        yield from check_teacher(cfg)
    for key, value, _, _ in dataset_files(cfg):
        if not Path(value).is_file():
            yield Problem((key,), f"{value} does not exist", f"set {key} to an existing .jsonl or .parquet file")
    yield from _check_output_dir(cfg.output_dir)


WEIGHTS = ("*.safetensors", "*.bin", "*.safetensors.index.json")
"""Files of which an HF checkpoint holds at least one: its weights."""
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which an HF checkpoint holds at least one: its tokenizer (the rollout and the data read it)."""


def _checkpoint_parts(path: Path, key: str = "model.path") -> Iterator[Problem]:
    """The weights and a tokenizer are there, and the tokenizer loads as the run will load it."""
    if not any(next(path.glob(pattern), None) for pattern in WEIGHTS):
        yield Problem((key,), f"{path} has a config.json but no weights ({', '.join(WEIGHTS)})",
                      f"point {key} at a complete HF checkpoint (huggingface-cli download <repo> --local-dir ...)")
    if not any((path / name).is_file() for name in TOKENIZER):
        yield Problem((key,), f"{path} has no tokenizer (none of {', '.join(TOKENIZER)})",
                      "copy the model's tokenizer files into it")
        return
    from slime_hydra.model.hf import load_tokenizer  # transformers: ~2 s to import, only for a checkpoint here

    try:
        load_tokenizer(path)
    except Exception as error:  # a damaged file of any of the formats AutoTokenizer reads
        yield Problem((key,), f"the tokenizer at {path} does not load: {type(error).__name__}: "
                      f"{str(error)[:300]}", f"point {key} at an intact HF checkpoint dir")


def check_teacher(cfg: SlimeConfig) -> Iterator[Problem]:
    """algo=opd: the teacher is a conf/model option or a complete checkpoint, the train backend runs its family (and,
    train=megatron, splits it as it splits the student), and it reads the student's tokens: the same vocabulary where
    each tokenizer is known before any build (a checkpoint's, or a built model's character tokenizer:
    model/teacher.tokenizer_of), the same kind where both are built. The tokenizers are compared again once both
    are built (model/teacher.resolve_teacher): a BPE tokenizer is trained on the task by the build."""
    from slime_hydra.model.teacher import option_file, teacher_option, tokenizer_difference, tokenizer_of

    key, given = "algo.teacher.path", cfg.algo.teacher.path
    try:
        teacher = teacher_option(given)
    except (OSError, ValueError) as error:
        yield Problem((key,), f"{given!r}: {error}", f"set {key} to an HF checkpoint dir or a conf/model option")
        return
    if option_file(given) is None:
        parts = list(_checkpoint_parts(Path(given), key))
        yield from parts
        if parts:
            return
    backend = cfg.train.backend
    if backend not in teacher.spec.backends:
        yield Problem((key, "train.backend"), f"train={backend} does not run the teacher's family {teacher.family}",
                      f"use train={teacher.spec.backends[0]}")
    megatron = TRAIN_BACKEND_KINDS[backend].sharding == "model_parallel"
    if megatron and teacher.is_moe:
        yield Problem((key, "train.backend"), "train=megatron holds a dense teacher only (not yet its experts)",
                      "use train=fsdp, or a dense teacher")
    if megatron and (teacher.num_attention_heads % cfg.train.tp or teacher.num_kv_heads % cfg.train.tp
                     or teacher.num_layers % cfg.train.pp):
        yield Problem((key, "train.tp", "train.pp"), f"the teacher's {teacher.num_attention_heads} heads, "
                      f"{teacher.num_kv_heads} KV heads and {teacher.num_layers} layers do not split over train.tp="
                      f"{cfg.train.tp}, train.pp={cfg.train.pp} as the student's do", "choose tp and pp dividing both")
    fix = "choose a teacher of the student's tokenizer"
    if (cfg.model.path, teacher.path) == (None, None) and cfg.model.tokenizer != teacher.tokenizer:
        yield Problem((key, "model.tokenizer"), f"the teacher builds a {teacher.tokenizer} tokenizer, the student a "
                      f"{cfg.model.tokenizer} one", fix)
        return
    if cfg.model.path is not None and not Path(cfg.model.path, "config.json").is_file():
        return  # reported above
    ours, theirs = tokenizer_of(cfg.model), tokenizer_of(teacher)
    why = tokenizer_difference(ours, theirs) if ours is not None and theirs is not None else None
    if why is not None:
        yield Problem((key, "model.path"), f"the teacher cannot score the student's tokens: {why}", fix)


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
