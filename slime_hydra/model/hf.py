"""HF transformers configs and random-init checkpoints built from a model option (no hub access needed).

Used for the embedded default (model=tiny), for tests (tiny random models of each family) and for speed
benchmarks on GPU machines (a Qwen2.5-0.5B-shaped model with random weights measures speed, not learning).
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from slime_hydra.model.config import ModelConfig
from slime_hydra.model.families import NULL_IS_A_VALUE

if TYPE_CHECKING:  # torch and transformers' model classes are imported where used: a process that only loads a
    import torch   # tokenizer (the driver, the rollout manager) saves ~5 s of CPU of importing them
    from transformers import PretrainedConfig


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, as the class its tokenizer_config.json declares when that is the generic fast one.

    transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type (a qwen2 model gets
    Qwen2Tokenizer, whose byte-level pre-tokenizer drops the tiny model's newline token) even when
    tokenizer_config.json names ``PreTrainedTokenizerFast``; every part of slime_hydra loads tokenizers here so
    the tiny tokenizer comes back exactly as it was saved (model/tiny.py).
    """
    config_file = Path(path) / "tokenizer_config.json"
    if config_file.exists() and json.loads(config_file.read_text()).get("tokenizer_class") == GENERIC_TOKENIZER:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer  # imports transformers' model registry (~3 s of CPU): only when needed

    return AutoTokenizer.from_pretrained(str(path))


GENERIC_TOKENIZER = "PreTrainedTokenizerFast"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
"""The files an HF checkpoint's tokenizer may consist of."""


def copy_tokenizer(model_path: str | Path, out: str | Path) -> list[str]:
    """Copy the tokenizer's files (TOKENIZER_FILES that ``model_path`` has) into ``out``, as they are (the tokenizer
    never trains, and a copy is exact where a save_pretrained round trip may rename its class); returns their
    names."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if (Path(model_path) / name).is_file():
            shutil.copyfile(Path(model_path) / name, Path(out) / name)
            copied.append(name)
    return copied


def save_tokenizer(tokenizer, save_dir) -> None:
    """save_pretrained, declaring the generic fast class so ``model.hf.load_tokenizer`` restores it exactly."""
    tokenizer.save_pretrained(save_dir)
    config_file = Path(save_dir) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = GENERIC_TOKENIZER
    config_file.write_text(json.dumps(config, indent=2))


def hf_config(model: ModelConfig, **overrides) -> "PretrainedConfig":
    """The transformers config of this model option, as its family's record (model/families.py) writes one: every
    field of ``Family.fields`` that the option sets (null ones left to transformers' default unless
    ``NULL_IS_A_VALUE``), then the family's
    fixed values (Qwen3-MoE: every layer sparse, top-k weights renormalised, no shared expert; GLM-4.5: q/k/v biases,
    no q/k norm; the grouped router renormalises its top-k), then ``overrides``. DeepSeek-V3 gets transformers'
    default interleaved RoPE layout and no rope scaling."""
    import transformers

    family = model.spec
    values = {key: getattr(model, name) for name, key in family.fields.items()
              if getattr(model, name) is not None or name in NULL_IS_A_VALUE}
    config = getattr(transformers, family.hf_config_class)(**{**values, **family.fixed, **overrides})
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):  # family defaults index the real vocabulary
        value = getattr(config, attr, None)
        if isinstance(value, int) and value >= model.vocab_size and attr not in overrides:
            setattr(config, attr, None)
    return config


def build_random_checkpoint(model: ModelConfig, out_dir: Path, seed: int = 0, dtype: Optional["torch.dtype"] = None,
                            tokenizer: Optional[object] = None, **overrides) -> Path:
    """Save a randomly initialised HF checkpoint of this architecture to out_dir (safetensors; ``dtype`` default
    fp32); return out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    config = hf_config(model, **overrides)
    net = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    net.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)
    return out_dir
