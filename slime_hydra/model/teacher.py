"""The teacher of on-policy distillation (algo.objective=opd): what it is, where its checkpoint is, and that it
reads and writes the student's tokens.

    teacher = teacher_option(cfg.algo.teacher.path)    # a ModelConfig: a conf/model option's, or read off config.json
    path = resolve_teacher(cfg, student_dir)           # its checkpoint dir (an option built offline: once, cached),
                                                       # its tokenizer checked against the student's; None: no opd
    why = tokenizer_difference(tokenizer_of(student), tokenizer_of(teacher))   # None: both map every token alike

``algo.teacher.path`` is either an HF checkpoint directory or the name of a ``conf/model`` option (a name with no
slash whose YAML exists): that option's ``path``, or where it is null its build offline as ``model=tiny``'s
(model/warm_start.py, on the run's task and seed). The teacher scores the student's token ids, so the two
vocabularies must be the same map from strings to ids, and the special tokens the same ids.
"""

import json
from pathlib import Path
from typing import Optional

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.families import FAMILIES
from slime_hydra.options import ConfigError, Problem

MODEL_OPTIONS = Path(__file__).resolve().parents[2] / "conf" / "model"
"""The conf/model options a teacher may be named by."""


def option_file(path: str) -> Optional[Path]:
    """The conf/model YAML that ``algo.teacher.path`` names, or None when it names a directory."""
    if "/" in path or path.startswith("."):
        return None
    candidate = MODEL_OPTIONS / f"{path}.yaml"
    return candidate if candidate.is_file() else None


def teacher_option(path: str) -> ModelConfig:
    """The teacher's architecture: its conf/model option, or the fields its config.json holds under the keys of its
    family's record (model/families.py). Raises ValueError saying what is missing or unknown."""
    from omegaconf import OmegaConf

    yaml = option_file(path)
    if yaml is not None:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(yaml)))
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is neither a conf/model option ({', '.join(sorted(options()))}) nor a directory "
                         "with a config.json")
    hf = json.loads(config_file.read_text())
    hf = {**hf.get("text_config", {}), **hf}
    family = FAMILIES.get(hf.get("model_type"))
    if family is None:
        raise ValueError(f"{config_file}: model_type {hf.get('model_type')!r} is not a family this platform runs "
                         f"({', '.join(FAMILIES)})")
    fields = {}
    for name in family.fields:
        value = next((hf[k] for k in family.config_json_keys(name) if k in hf), None)
        if value is not None:
            fields[name] = value
    return ModelConfig(name=Path(path).name, family=family.name, path=str(path), **fields)


def options() -> list[str]:
    return [p.stem for p in MODEL_OPTIONS.glob("*.yaml")]


def resolve_teacher(cfg, student: Path, log=print) -> Optional[Path]:
    """algo.objective=opd: the teacher's checkpoint directory, an option with a null path built (and cached) as the
    student would be (model/warm_start.resolve_model_path, on the run's task and seed); then its tokenizer compared
    with the student's (ConfigError naming algo.teacher.path when they differ). None for the other objectives.
    ``cfg``: the SlimeConfig (not imported: the model layer sits below config)."""
    from slime_hydra.model.warm_start import resolve_model_path

    if not cfg.algo.distills:
        return None
    path = resolve_model_path(teacher_option(cfg.algo.teacher.path), cfg.data, cfg.seed, log=log)
    from slime_hydra.model.hf import load_tokenizer

    why = tokenizer_difference(load_tokenizer(student), load_tokenizer(path))
    if why is not None:
        raise ConfigError([Problem(("algo.teacher.path", "model.path"), f"the teacher at {path} cannot score the "
                                   f"student's tokens: {why}", "choose a teacher of the student's tokenizer")])
    return path


def tokenizer_of(model: ModelConfig):
    """The tokenizer a model option's run will use, where it is known before any build: its checkpoint's, or the
    character tokenizer (model/tiny.py) of a built one; None for a BPE tokenizer not yet trained (model/bpe.py)."""
    if model.path is not None:
        from slime_hydra.model.hf import load_tokenizer

        return load_tokenizer(model.path)
    if model.tokenizer == "char":
        from slime_hydra.model.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    return None


def tokenizer_difference(ours, theirs) -> Optional[str]:
    """Why a teacher of tokenizer ``theirs`` cannot score the tokens of a student of tokenizer ``ours``, or None: both
    vocabularies map the same strings to the same ids, and EOS and padding are the same ids."""
    a, b = ours.get_vocab(), theirs.get_vocab()
    if a != b:
        differ = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
        example = ", ".join(f"{t!r}: {a.get(t)} vs {b.get(t)}" for t in differ[:3])
        return (f"the student's vocabulary has {len(a)} tokens, the teacher's {len(b)}, and {len(differ)} tokens map "
                f"to different ids (student vs teacher: {example})")
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(ours, name) != getattr(theirs, name):
            return (f"{name} is {getattr(ours, name)} in the student's tokenizer, {getattr(theirs, name)} in the "
                    "teacher's")
    return None
