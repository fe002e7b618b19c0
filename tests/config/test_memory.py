"""The memory plan (config/memory.py): refusals with the numbers and fixes that really fit, and its estimates against
what torch allocated on an H100 (docs/benchmarks.md, "The memory plan against measurement")."""

import pytest

from slime_hydra.config import ConfigError, compose, to_config
from slime_hydra.config.derive import derive
from slime_hydra.config.memory import GiB, engine_usage, param_counts, plan_memory, trainer_usage
from tests.config.helpers import load, problems

H100 = ("cluster=slurm_8xh100", "model.path=/ckpt/model")


def test_a_9b_model_on_this_cpu_machine_is_refused_with_its_size_and_where_to_run_it():
    error = problems("model=glm4_9b", "algo=grpo", "model.path=/ckpt/glm4_9b", "cluster.mem_gb=24")
    (problem,) = [p for p in error.problems if "cluster.gpus_per_node" in p.keys]
    assert "CPU-only machine" in problem.message and "glm4_9b has 9.4B parameters" in problem.message
    need = int(problem.message.split("needs ~")[1].split(" GiB")[0])
    assert 150 <= need <= 500  # fp32 trainer + Adam + engine + reference and checkpoint copies of 9.4B parameters
    assert "cluster=<a GPU site" in problem.fix


def test_the_first_command_with_a_gpu_site_plans_and_without_one_is_refused(tmp_path):
    """`python launch.py model=glm4_9b algo=grpo`: refused here with the memory it needs, planned on 8 x H100."""
    from tests.config.test_launch import launch

    here = launch("model=glm4_9b", "algo=grpo", "model.path=/ckpt/glm4_9b", "cluster.mem_gb=24", cwd=tmp_path)
    assert here.returncode == 2 and "[cluster.gpus_per_node, model]" in here.stderr and "GiB of host RAM" in here.stderr
    planned = launch("model=glm4_9b", "algo=grpo", "cluster=slurm_8xh100", f"model.path={tmp_path}", "dry_run=true",
                     cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert "per GPU (80 GiB): trainer rank" in planned.stdout and "dry run: config valid" in planned.stdout


@pytest.mark.parametrize("model", ["qwen2_5_0_5b", "qwen3_0_6b", "qwen3_4b", "qwen2_5_7b", "qwen3_8b", "llama3_1_8b",
                                   "glm4_9b"])
def test_every_dense_model_plans_on_an_8xh100_node_with_its_defaults(model):
    """conf/tuning/<model>.yaml sizes train.num_gpus (and the embedded engine's concurrency) so the defaults fit."""
    cfg, d = load(f"model={model}", *H100)
    assert plan_memory(cfg, d).gpu_peak <= 80 * GiB and d.total_gpus <= 8


def test_a_9b_model_on_one_h100_is_refused_and_the_suggested_fix_plans():
    error = problems("model=glm4_9b", "algo=grpo", *H100, "train.num_gpus=1")
    (problem,) = error.problems
    assert problem.keys[0] == "cluster.gpu_memory_gb" and "trainer rank" in problem.message
    assert "does not fit a GPU of 80 GiB" in problem.message
    assert "try train.num_gpus=4" in problem.fix  # 2 GPUs still hold ~91 GiB a rank; 4 fit
    load("model=glm4_9b", "algo=grpo", *H100, "train.num_gpus=4")


@pytest.mark.parametrize("overrides", [
    ("model=glm4_9b", "train.num_gpus=1"),
    ("model=qwen3_8b", "train.num_gpus=2", "train.micro_batch_samples=8"),
    ("model=qwen3_4b", "train.num_gpus=1", "rollout.max_response_tokens=4096", "train.micro_batch_samples=4"),
    ("model=qwen2_5_7b", "train.num_gpus=8", "rollout.num_gpus=8", "rollout.max_concurrency_per_engine=512",
     "rollout.batch_prompts=64", "rollout.max_response_tokens=8192"),
])
def test_every_suggested_fix_removes_its_problem_and_adds_none(overrides):
    """The fixes are re-planned before they are offered: applying one of them leaves the other problems only."""
    error = problems(*H100, *overrides)
    checked = 0
    for problem in error.problems:
        role = problem.message.split(":")[0]  # "trainer rank", "engine", ...
        fixes = problem.fix.removeprefix("try ").split("; or ") if problem.fix.startswith("try ") else []
        for fix in fixes:
            try:
                load(*H100, *overrides, *fix.split())
                left = []
            except ConfigError as still:
                left = still.problems
            assert len(left) < len(error.problems), (fix, left)
            assert not any(p.message.startswith(role + ":") for p in left), (fix, left)
            checked += 1
    assert checked >= 1, error


def test_the_engine_is_refused_on_its_own_with_engine_fixes():
    """An 8B model on the embedded engine with 256 concurrent 9k-token sequences: the slot cache cannot fit."""
    error = problems("model=qwen3_8b", *H100, "train.num_gpus=4", "rollout.num_gpus=4",
                     "rollout.max_response_tokens=8192", "train.gradient_checkpointing=true")
    (problem,) = error.problems
    assert problem.message.startswith("engine: ") and "KV cache" in problem.message
    assert "rollout.max_concurrency_per_engine" in problem.keys
    assert "rollout.max_concurrency_per_engine=" in problem.fix


def test_capacities_unknown_refuse_nothing():
    """A plan that would not fit an 80 GiB GPU passes validation when the site states no GPU memory."""
    cfg, d = load("model=glm4_9b", "cluster=slurm", "model.path=/ckpt/glm4_9b", "train.num_gpus=1")
    plan = plan_memory(cfg, d)
    assert plan.gpu_capacity is None and plan.gpu_peak > 80 * GiB


def test_the_cpu_default_fits_this_machine():
    cfg, d = load()
    plan = plan_memory(cfg, d)
    assert not plan.on_gpu and plan.host.total < 4 * GiB


def test_background_checkpoints_count_one_host_copy_of_weights_and_adam_state():
    """checkpoint_in_background: 12 bytes per parameter of each trainer rank's shard on the host (fp32 masters and
    Adam's two moments, train/checkpoint_writer.py); off, nothing."""
    model = load("model=qwen2_5_0_5b", *H100)[0]
    params = param_counts(model).total(model.model.num_layers)
    for ranks in (1, 2):
        on = plan_memory(*load("model=qwen2_5_0_5b", *H100, f"train.num_gpus={ranks}")).host.parts
        off = plan_memory(*load("model=qwen2_5_0_5b", *H100, f"train.num_gpus={ranks}",
                                "checkpoint_in_background=false")).host.parts
        assert on["checkpoint copy"] == pytest.approx(12 * params)  # FSDP: `ranks` ranks of a node, 1/ranks each
        assert "checkpoint copy" not in off and {k: v for k, v in on.items() if k != "checkpoint copy"} == off


def _usage(role, *overrides):
    cfg = to_config(compose(["cluster=slurm", "cluster.gpus_per_node=1", "model.path=/x", *overrides]))
    usage = role(cfg, derive(cfg))
    usage.parts.pop("CUDA reserve", None)  # compared with torch's max_memory_allocated, which excludes it
    return usage.total / GiB


BENCH = ("train.num_gpus=1", "rollout.num_gpus=1", "cluster.colocate=false", "data.max_prompt_tokens=256",
         "rollout.max_response_tokens=768", "train.global_batch_samples=8", "train.micro_batch_samples=8")
LOOP = ("model=qwen2_5_0_5b", "train.num_gpus=1", "train.micro_batch_samples=32", "rollout.batch_prompts=32",
        "rollout.n_samples_per_prompt=8", "rollout.max_response_tokens=128", "cluster.colocate=true")


@pytest.mark.parametrize("role, overrides, measured_gib", [
    # scripts/bench_train.py, 8 x 1024 tokens (256 prompt), one H100, 2026-11-23/24
    (trainer_usage, ("model=qwen2_5_0_5b", *BENCH), 20.96),
    (trainer_usage, ("model=qwen2_5_0_5b", *BENCH, "train.gradient_checkpointing=true"), 13.86),
    (trainer_usage, ("model=qwen2_5_0_5b", *BENCH, "train.compile=false"), 34.49),
    (trainer_usage, ("model=qwen2_5_0_5b", *BENCH, "train=megatron"), 21.33),
    (trainer_usage, ("model=qwen2_5_0_5b", *BENCH, "train=megatron", "train.compile=false"), 35.35),
    (trainer_usage, ("model=qwen3_0_6b", *BENCH), 24.52),
    (trainer_usage, ("model=qwen3_4b", *BENCH, "train.global_batch_samples=2", "train.micro_batch_samples=2",
                     "train.gradient_checkpointing=true"), 75.51),
    # scripts/bench_loop_gpu.sh colocated (the loop's trainer_gpu_peak_gb / engine_gpu_peak_gb), 2026-11-24
    (trainer_usage, LOOP, 17.96),
    (engine_usage, LOOP, 2.58),
])
def test_estimates_are_within_10_percent_of_the_h100_measurements(role, overrides, measured_gib):
    assert _usage(role, *overrides) == pytest.approx(measured_gib, rel=0.10)


def test_lora_plans_a_7b_model_on_one_h100_that_full_fine_tuning_cannot_hold():
    """train.lora: a frozen bf16 base (2 bytes / parameter) and fp32 adapters with their grads and Adam moments
    (16 bytes / adapter parameter) in place of 16 + 4 bytes / parameter; no reference copy on the host."""
    one = ("model=qwen2_5_7b", *H100, "train.num_gpus=1", "cluster.colocate=true")
    with pytest.raises(ConfigError, match="does not fit a GPU of 80 GiB"):
        load(*one)
    cfg, d = load(*one, "train.lora.rank=32")
    plan = plan_memory(cfg, d)
    assert plan.gpu_peak <= 80 * GiB
    trainer = trainer_usage(cfg, d)
    params = param_counts(cfg).total(cfg.model.num_layers)
    m = cfg.model
    q, kv = m.num_attention_heads * m.kv_channels, m.num_kv_heads * m.kv_channels
    per_layer = 32 * ((m.hidden_size + q) + 2 * (m.hidden_size + kv) + (q + m.hidden_size)
                      + 2 * (m.hidden_size + m.ffn_hidden_size) + (m.ffn_hidden_size + m.hidden_size))
    assert trainer.parts["frozen base"] == params * 2
    assert trainer.parts["fp32 adapters + grads"] == per_layer * m.num_layers * 8
    assert "fp32 masters + grads" not in trainer.parts and "bf16 compute copy" not in trainer.parts
    assert "reference copies" not in plan.host.parts


def test_routed_experts_are_planned_per_ep_rank():
    """Qwen3-30B-A3B on two 8 x H100 nodes (train=megatron, TP2): its 29B routed-expert parameters split over TP x
    EP, their Adam state over the DP x CP / EP ranks that hold the same experts; the rest over TP and DP x CP."""
    def trainer(ep: int):
        cfg = to_config(compose(["model=qwen3_30b_a3b", *H100, "train=megatron", "train.num_gpus=16", "train.tp=2",
                                 f"train.ep={ep}"]))
        return cfg, trainer_usage(cfg, derive(cfg))

    cfg, spread = trainer(8)
    counts, m = param_counts(cfg), cfg.model
    experts = m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size * m.num_layers
    assert counts.experts_per_layer * m.num_layers == experts == 28_991_029_248
    rest = counts.total(m.num_layers) - experts
    per_rank = rest / 2 + experts / (2 * 8)
    assert spread.parts["fp32 masters + grads"] == pytest.approx(per_rank * 8)
    assert spread.parts["Adam state"] == pytest.approx((rest / 2 / 8 + experts / 16 / 1) * 8)  # DP 8, EP 8: 1 peer
    _, whole = trainer(1)
    assert whole.parts["fp32 masters + grads"] == pytest.approx((rest + experts) / 2 * 8)
    assert whole.total > 80 * GiB > spread.total


def test_shared_experts_and_dense_first_layers_are_counted():
    """GLM-4.5-Air: 45 MoE layers of 128 routed experts, one shared expert and a router, and a first layer with a
    dense MLP (10944 wide): 106.9B parameters (the model card's 106B; its multi-token-prediction layer is not
    trained). On 16 H100s (train=megatron TP4 x EP4 x DP4) the busiest rank holds the dense layer's and the shared
    experts' share over TP, the routed experts' over TP x EP."""
    cfg = to_config(compose(["model=glm4_5_air", *H100, "train=megatron", "train.num_gpus=16", "train.tp=4",
                             "train.ep=4"]))
    m, counts = cfg.model, param_counts(cfg)
    hidden, expert = m.hidden_size, 3 * m.hidden_size * m.moe_ffn_hidden_size
    attention = hidden * 96 * 128 + 2 * hidden * 8 * 128 + 96 * 128 * hidden + (96 + 16) * 128
    moe_layer = attention + 128 * expert + expert + 128 * hidden + 4 * hidden
    dense_layer = attention + 3 * hidden * 10944 + 4 * hidden
    total = 45 * moe_layer + dense_layer + 2 * 151552 * hidden + hidden
    assert counts.total(m.num_layers) == total and 106e9 < total < 107.5e9
    trainer = trainer_usage(cfg, derive(cfg))
    experts = 45 * 128 * expert
    assert trainer.parts["fp32 masters + grads"] == pytest.approx(((total - experts) / 4 + experts / 16) * 8)


def test_deepseek_v3_recipe_plans_on_64_nodes_and_32_would_not_hold_it(tmp_path):
    """DeepSeek-V3: 671.0B parameters (multi-latent attention's projections, 58 MoE layers of 256 experts + 1 shared,
    3 dense ones). Its recipe (TP8 x EP64 x DP64 on 64 nodes of 8 x H100, colocated with SGLang) plans under 80 GiB
    per GPU and a node's 1000 GiB of host RAM, through launch.py's dry run; the same at TP8 x EP32 on 32 nodes is
    refused with the memory it would need."""
    from tests.config.test_launch import launch

    recipe = ("recipes=deepseek_v3_grpo_64x8xh100", "cluster=slurm_8xh100", f"model.path={tmp_path}")
    cfg = to_config(compose(list(recipe)))
    m, counts = cfg.model, param_counts(cfg)
    hidden, heads, expert = m.hidden_size, m.num_attention_heads, 3 * m.hidden_size * m.moe_ffn_hidden_size
    attention = (hidden * 1536 + 1536 + 1536 * heads * 192 + hidden * (512 + 64) + 512 + 512 * heads * (128 + 128)
                 + heads * 128 * hidden)
    moe_layer = attention + 256 * expert + expert + 256 * hidden + 4 * hidden
    dense_layer = attention + 3 * hidden * 18432 + 4 * hidden
    assert counts.total(m.num_layers) == 58 * moe_layer + 3 * dense_layer + 2 * 129280 * hidden + hidden
    assert 670.5e9 < counts.total(m.num_layers) < 671.5e9
    plan = plan_memory(cfg, derive(cfg))
    assert plan.gpu_peak <= 80 * GiB and plan.host.total <= 1000 * GiB
    planned = launch(*recipe, "dry_run=true", cwd=tmp_path)
    assert planned.returncode == 0 and "dry run: config valid" in planned.stdout, planned.stderr
    error = problems(*recipe, "train.num_gpus=256", "rollout.num_gpus=256", "train.ep=32")
    assert any("does not fit a GPU of 80 GiB" in p.message for p in error.problems), error


def test_colocated_roles_stay_resident_where_the_plan_fits_them_together_and_move_where_not():
    """cluster.colocate_offload=auto: nothing moves where trainer + engine fit 90% of the GPU (the 0.5B loop on an
    H100), memory moves where they do not (the 7B LoRA run); never on a run that does not fit is refused with the
    fix; always moves in any case."""
    small = (*H100, *LOOP)
    cfg, d = load(*small)
    plan = plan_memory(cfg, d)
    trainer, engine = trainer_usage(cfg, d).total, engine_usage(cfg, d).total
    assert plan.colocated_moves is False and trainer + engine <= 0.9 * 80 * GiB
    (shared,) = plan.gpu
    assert shared.role == "colocated GPU (trainer and engine both resident)"
    assert shared.total == pytest.approx(trainer + engine + 2 * 1.5 * GiB)
    assert "trainer offload" not in plan.host.parts and "parked engine weights" not in plan.host.parts
    moving = plan_memory(*load(*small, "cluster.colocate_offload=always"))
    assert moving.colocated_moves is True and "trainer offload" in moving.host.parts
    assert moving.gpu_peak < plan.gpu_peak
    big = ("model=qwen2_5_7b", *H100, "train.num_gpus=1", "cluster.colocate=true", "train.lora.rank=32")
    assert plan_memory(*load(*big)).colocated_moves is True
    with pytest.raises(ConfigError, match="both resident.*does not fit a GPU of 80 GiB") as error:
        load(*big, "cluster.colocate_offload=never")
    assert "cluster.colocate_offload=always" in str(error.value)
    assert plan_memory(*load(*H100, "model=qwen2_5_0_5b", *BENCH)).colocated_moves is None  # not colocated
