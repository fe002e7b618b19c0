"""Every group option and every recipe composes and validates; derived values follow their formulas."""

import re
import shutil

import pytest
import yaml

from slime_hydra.config import PROJECT_ROOT, compose, to_config
from slime_hydra.config.store import GROUP_SCHEMAS
from tests.config.helpers import load

CONF = PROJECT_ROOT / "conf"

# The minimal deltas that make an option valid on top of the embedded default (named for each option that
# needs more than itself: a model other than tiny needs its checkpoint directory, and so on). Real models compose
# on a SLURM cluster whose memory is not stated, so the memory plan (tests/config/test_memory.py) refuses nothing
# here; on this CPU machine most would not fit.
REAL_MODEL = ("model=qwen2_5_0_5b", "model.path=/ckpt/qwen2_5_0_5b", "rollout.max_response_tokens=1024", "cluster=slurm",
              "rollout.num_gpus=1")
NEEDS = {
    ("model", "*"): ("model.path=/ckpt/dir", "cluster=slurm", "rollout.num_gpus=1"),
    ("algo", "*"): REAL_MODEL,
    ("data", "*"): REAL_MODEL,
    ("algo", "sft"): ("rollout.n_samples_per_prompt=1",),  # one response a row (rules.check_objective)
    ("algo", "opd"): ("algo.teacher.path=/ckpt/teacher",),
    ("algo", "dpo"): ("rollout.n_samples_per_prompt=2",),  # a chosen and a rejected response a row  # a path only read by pre-flight's file checks
    ("data", "jsonl"): ("data.path=/data/train.jsonl",),
    ("data", "countdown"): ("reward=task",),
    ("data", "sorting"): ("reward=task",),
    ("data", "calculator"): ("reward=task", "rollout.generate=slime_hydra.rollout.examples.calculator_tool.calculator_generate"),
    ("reward", "task"): ("data=arithmetic",),
    ("reward", "remote"): ("reward.url=http://127.0.0.1:8000/score",),
    ("reward", "custom"): ("reward.target=slime_hydra.reward.exact_match.exact_match_reward",),
    ("rollout", "sglang"): ("cluster.gpus_per_node=8", "rollout.num_gpus=1"),
    ("debug", "train_only"): ("debug.rollout_path=/runs/x/rollouts",),
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


ALL_OPTIONS = [(g, o) for g in GROUP_SCHEMAS for o in _options(g)]


def test_every_group_has_options_and_its_options_are_typed_by_the_schema(tmp_path):
    """An option YAML merges into its group's typed slice of the root schema (base_config): a misspelt key and a value
    of the wrong type in an option file fail at composition, naming the file and the key. The shipped options do not
    load their group's schema again (``defaults: [base_<group>, _self_]``, which a site's own file may keep)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    assert {g for g, _ in ALL_OPTIONS} == set(GROUP_SCHEMAS)
    assert not [f"{g}={o}" for g, o in ALL_OPTIONS if "base_" in (CONF / g / f"{o}.yaml").read_text()]
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model" / "typo.yaml").write_text("name: typo\nnum_layer: 4\n")
    (conf / "model" / "wrong_type.yaml").write_text("name: wrong_type\nhidden_size: wide\n")
    (conf / "cluster" / "site.yaml").write_text("defaults: [base_cluster, _self_]\nscheduler: slurm\n")
    compose()  # registers the schemas
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        for option, says in (("typo", "Key 'num_layer' not in 'ModelConfig'"),
                             ("wrong_type", "Value 'wide' of type 'str' could not be converted to Integer")):
            with pytest.raises(ConfigCompositionException) as refused:
                hydra_compose("config", overrides=[f"model={option}"])
            assert f"In 'model/{option}'" in str(refused.value) and says in str(refused.value), str(refused.value)
        assert hydra_compose("config", overrides=["cluster=site"]).cluster.scheduler == "slurm"


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_option_composes_and_validates(group, option):
    extra = () if (group, option) == ("model", "tiny") else (
        NEEDS.get((group, "*"), ()) + NEEDS.get((group, option), ()))
    cfg, derived = load(f"{group}={option}", *extra)
    if group == "model":
        assert cfg.model.name == option
    if group == "algo":
        assert cfg.algo.name == option
    assert derived.samples_per_rollout == cfg.rollout.batch_prompts * cfg.rollout.n_samples_per_prompt


RECIPES = sorted(p.stem for p in (PROJECT_ROOT / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_validates_and_documents_itself(recipe):
    text = (PROJECT_ROOT / "recipes" / f"{recipe}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    assert f"python launch.py recipes={recipe}" in text, "the header gives the exact command"
    assert "# Hardware:" in text and "# Expect:" in text, "the header gives the hardware and the result to expect"
    site = re.search(r"cluster=<your site, e\.g\. (\w+)>", text)  # planned on the site it names: its GPUs' memory
    cfg, derived = load(f"recipes={recipe}", *([f"cluster={site.group(1)}"] if site else []))
    assert derived.global_batch_samples * derived.optimizer_steps_per_rollout == derived.samples_per_rollout


def test_recipe_families_cover_every_model_family():
    families = {to_config(compose([f"recipes={r}"])).model.family for r in RECIPES}
    assert {"qwen2", "qwen3", "qwen3_moe", "llama", "glm4", "deepseek_v3"} <= families


def test_embedded_default_values_and_tiny_tuning():
    cfg, d = load()
    assert (cfg.model.name, cfg.algo.name, cfg.rollout.backend, cfg.train.backend) == ("tiny", "grpo", "embedded", "fsdp")
    assert (cfg.train.lr, cfg.train.dtype, cfg.num_steps, cfg.model.sft_warm_start_steps) == (2e-4, "fp32", 200, 350)
    # ... conf/tuning/tiny.yaml applies for model=tiny ...
    big, _ = load("model=qwen3_8b", "model.path=/ckpt", "cluster=slurm", "rollout.num_gpus=1")
    assert (big.train.lr, big.train.dtype, big.num_steps) == (1e-6, "bf16", 200)  # ... and only for it
    assert (d.samples_per_rollout, d.global_batch_samples, d.optimizer_steps_per_rollout) == (256, 256, 1)
    assert (d.dp, d.grad_accum_steps, d.total_gpus, d.nodes) == (1, 4, 2, 1)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        # (global, steps) derived from whichever is set: 32 x 8 = 256 samples per rollout
        (("train.global_batch_samples=64",), (64, 4)),
        (("train.optimizer_steps_per_rollout=2",), (128, 2)),
        (("train.global_batch_samples=128", "train.optimizer_steps_per_rollout=2"), (128, 2)),
        (("rollout.batch_prompts=16", "rollout.n_samples_per_prompt=4"), (64, 1)),
    ],
)
def test_batch_derivation(overrides, expected):
    _, d = load(*overrides)
    assert (d.global_batch_samples, d.optimizer_steps_per_rollout) == expected


def test_nodes_are_derived_from_gpus():
    # 16 train + 8 rollout GPUs on 8-GPU nodes = 3 nodes; colocated 16 GPUs = 2 nodes.
    base = ("model=qwen3_8b", "model.path=/c", "cluster=slurm_8xh100", "train=megatron", "train.num_gpus=16",
            "train.tp=4", "rollout=sglang", "rollout.gpus_per_engine=2")
    _, d = load(*base, "rollout.num_gpus=8")
    assert (d.dp, d.total_gpus, d.nodes, d.num_engines) == (4, 24, 3, 4)
    _, d = load(*base, "cluster.colocate=true", "rollout.num_gpus=null")
    assert (d.rollout_gpus, d.total_gpus, d.nodes, d.num_engines) == (16, 16, 2, 8)


def test_sweeps_are_sweeper_params_over_real_keys():
    from slime_hydra.config.keys import check_key

    sweeps = sorted((PROJECT_ROOT / "sweeps").glob("*.yaml"))
    assert len(sweeps) >= 2
    for path in sweeps:
        cfg = load(f"sweeps={path.stem}")[0]  # composes on top of the default
        params = yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"]
        assert params, path
        for key in params:
            assert check_key(key) is None, f"{path.name}: {key} is not a config key"
        assert cfg.num_steps > 0
