"""Pre-flight validation: every problem of a config, found before anything starts, all reported at once.

``validate(cfg)`` runs locally, in dry runs and before every sbatch. First each field against its declared domain
and each group's own ``check`` (``options.domain_problems``: choices, ranges and single-group rules live beside the
fields in ``slime_hydra/<component>/config.py``) and the passthrough option names; then, on a config whose counts
hold (the arithmetic divides by them), the rules below, each relating keys of several groups. Every rule is a
small function yielding ``Problem``s that name the key(s) and the override that fixes it.
"""

from typing import Callable, Iterator

from slime_hydra.algo.config import GROUP_ESTIMATORS, AlgoConfig
from slime_hydra.data.config import MAX_LEVELS
from slime_hydra.data.tasks import get_env
from slime_hydra.reward.config import REWARD_NAMES
from slime_hydra.config.derive import Derived, derive
from slime_hydra.config.memory import memory_problems, plan_memory
from slime_hydra.config.objectives import check_objective
from slime_hydra.config.passthrough import check_passthrough
from slime_hydra.config.plugins import check_plugins
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.dotted import import_callable
from slime_hydra.model.families import FAMILIES
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
from slime_hydra.options import ConfigError, Problem, counts_hold, domain_problems
from slime_hydra.train.config import gate_up_problem
from slime_hydra.train.kinds import PARALLEL_DIMS, TRAIN_BACKEND_KINDS


def check_layout(cfg: SlimeConfig) -> Iterator[Problem]:
    """The training ranks split into whole model replicas (dp = num_gpus / (tp x pp x cp) >= 1): every other
    cross-group rule divides by dp."""
    t = cfg.train
    if t.num_gpus % t.model_parallel_size:
        yield Problem(("train.num_gpus", "train.tp", "train.pp", "train.cp"),
                      f"train.num_gpus={t.num_gpus} is not divisible by tp({t.tp}) x pp({t.pp}) x cp({t.cp}) = "
                      f"{t.model_parallel_size}",
                      f"set train.num_gpus to a multiple of {t.model_parallel_size}")


def check_backend(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """What a trainer backend would refuse when it starts, refused here instead (no job dies after its allocation)."""
    t, m = cfg.train, cfg.model
    if t.backend not in m.spec.backends:
        yield Problem(("train.backend", "model.family"), f"train={t.backend} does not train model.family={m.family} "
                      f"(its record, model/families.py, lists {', '.join(m.spec.backends)})",
                      f"use train={m.spec.backends[0]}")
    if cfg.rollout.backend not in m.spec.engines:
        yield Problem(("rollout.backend", "model.family"), f"rollout={cfg.rollout.backend} does not serve "
                      f"model.family={m.family} (its record, model/families.py, lists {', '.join(m.spec.engines)})",
                      f"use rollout={m.spec.engines[0]}")
    kind = TRAIN_BACKEND_KINDS[t.backend]
    unsplit = [dim for dim in PARALLEL_DIMS if getattr(t, dim) > 1 and dim not in kind.parallelism]
    if unsplit:
        splitting = [k.name for k in TRAIN_BACKEND_KINDS.values() if set(unsplit) <= set(k.parallelism)]
        yield Problem(("train.backend", *(f"train.{dim}" for dim in unsplit)),
                      f"train={t.backend} does not split a model replica by "
                      f"{', '.join(f'{dim}={getattr(t, dim)}' for dim in unsplit)} (it parallelises "
                      f"{'by ' + ', '.join(kind.parallelism) if kind.parallelism else 'over data only'})",
                      (f"use train={splitting[0]}, or " if splitting else "")
                      + "set " + " ".join(f"train.{dim}=1" for dim in unsplit))
    wanted = (("packing", t.pack_sequences, "train.pack_sequences=true", "set train.pack_sequences=false"),
              ("lora", t.lora.rank > 0, f"train.lora.rank={t.lora.rank}", "set train.lora.rank=0"),
              ("moe", cfg.model.spec.moe, f"model.family={cfg.model.family} (mixture of experts)", None))
    for feature, used, setting, fix in wanted:
        if used and not getattr(kind, feature):
            able = [k.name for k in TRAIN_BACKEND_KINDS.values() if getattr(k, feature)]
            yield Problem(("train.backend", setting.split("=")[0]), f"train={t.backend} does not train with {setting} "
                          f"(its record, train/kinds.py, has {feature}=False)",
                          ", or ".join([f"use train={able[0]}"] * bool(able) + [fix] * bool(fix)))
    if kind.rules is not None:
        yield from import_callable(kind.rules, "train backend rules", "fn(cfg, derived)")(cfg, d)


def check_batch(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    t, r = cfg.train, cfg.rollout
    gb, steps = t.global_batch_samples, t.optimizer_steps_per_rollout
    prompts_x_n = f"rollout.batch_prompts({r.batch_prompts}) x rollout.n_samples_per_prompt({r.n_samples_per_prompt})"
    if gb is not None and steps is not None and gb * steps != d.samples_per_rollout:
        yield Problem(("train.global_batch_samples", "train.optimizer_steps_per_rollout", "rollout.batch_prompts"),
                      f"{prompts_x_n} = {d.samples_per_rollout} samples per rollout, but global_batch_samples({gb}) x "
                      f"optimizer_steps_per_rollout({steps}) = {gb * steps}",
                      f"set train.optimizer_steps_per_rollout=null to derive it, or "
                      f"train.global_batch_samples={d.samples_per_rollout // steps}")
    elif gb is None and steps is not None and d.samples_per_rollout % steps:
        yield Problem(("train.optimizer_steps_per_rollout",),
                      f"{d.samples_per_rollout} samples per rollout do not split into {steps} equal optimizer steps",
                      f"try train.optimizer_steps_per_rollout={_divisor_near(d.samples_per_rollout, steps)}")
    elif d.samples_per_rollout % d.global_batch_samples or d.global_batch_samples > d.samples_per_rollout:
        yield Problem(("train.global_batch_samples", "rollout.batch_prompts", "rollout.n_samples_per_prompt"),
                      f"{prompts_x_n} = {d.samples_per_rollout} samples per rollout is not a multiple of "
                      f"train.global_batch_samples={d.global_batch_samples}",
                      f"try train.global_batch_samples={_divisor_near(d.samples_per_rollout, d.global_batch_samples)}")
    per_step = t.micro_batch_samples * d.dp
    if d.global_batch_samples % per_step:
        yield Problem(("train.global_batch_samples", "train.micro_batch_samples", "train.num_gpus"),
                      f"global_batch_samples={d.global_batch_samples} is not divisible by micro_batch_samples"
                      f"({t.micro_batch_samples}) x dp({d.dp}) = {per_step}",
                      f"try train.micro_batch_samples={_divisor_near(d.global_batch_samples // d.dp or 1, t.micro_batch_samples)}"
                      if d.global_batch_samples % d.dp == 0 else
                      f"make global_batch_samples a multiple of dp={d.dp}")


def check_parallelism(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    t, m = cfg.train, cfg.model
    if m.num_attention_heads % t.tp:
        yield Problem(("train.tp", "model.num_attention_heads"),
                      f"model.num_attention_heads={m.num_attention_heads} is not divisible by train.tp={t.tp}",
                      f"choose train.tp among {divisors(m.num_attention_heads)}")
    if m.num_kv_heads % t.tp:
        yield Problem(("train.tp", "model.num_kv_heads"),
                      f"model.num_kv_heads={m.num_kv_heads} is not divisible by train.tp={t.tp}",
                      f"choose train.tp among {divisors(m.num_kv_heads)}")
    # Megatron's uneven pipeline: the first/last stage may hold a given number of layers, the rest split evenly.
    uneven = {k: t.megatron[k] for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
              if isinstance(t.megatron.get(k), int)}
    even_layers, even_stages = m.num_layers - sum(uneven.values()), t.pp - len(uneven)
    if even_stages > 0 and (even_layers < even_stages or even_layers % even_stages):
        if uneven:
            yield Problem(("train.pp", "model.num_layers", *(f"train.megatron.{k}" for k in uneven)),
                          f"{m.num_layers} layers minus the uneven stages ({sum(uneven.values())}) leave {even_layers} "
                          f"layers for {even_stages} stages", "adjust the first/last stage layer counts")
        else:
            yield Problem(("train.pp", "model.num_layers"),
                          f"model.num_layers={m.num_layers} is not divisible by train.pp={t.pp}",
                          f"choose train.pp among {divisors(m.num_layers)}, or give the first/last stage its own "
                          "count (train.megatron.num_layers_in_first_pipeline_stage)")


def check_rollout(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    r, m = cfg.rollout, cfg.model
    if d.rollout_gpus == 0 and cfg.debug.mode != "train_only":
        yield Problem(("rollout.num_gpus", "cluster.colocate"),
                      "no GPUs for the engines: rollout.num_gpus is null and the roles are not colocated",
                      "set rollout.num_gpus=N, or cluster.colocate=true to share the training GPUs")
    elif d.rollout_gpus % r.gpus_per_engine:
        yield Problem(("rollout.num_gpus", "rollout.gpus_per_engine"),
                      f"rollout GPUs ({d.rollout_gpus}) are not divisible by rollout.gpus_per_engine={r.gpus_per_engine}",
                      f"set rollout.num_gpus to a multiple of {r.gpus_per_engine}")
    if m.num_attention_heads % r.gpus_per_engine:
        yield Problem(("rollout.gpus_per_engine", "model.num_attention_heads"),
                      f"engine TP (rollout.gpus_per_engine={r.gpus_per_engine}) does not divide "
                      f"model.num_attention_heads={m.num_attention_heads}",
                      f"choose rollout.gpus_per_engine among {divisors(m.num_attention_heads)}")
    kind = ENGINE_KINDS[r.backend]
    if cfg.train.weight_sync != "auto" and cfg.train.weight_sync not in kind.weight_syncs:
        yield Problem(("train.weight_sync", "rollout.backend"),
                      f"rollout={r.backend} engines take weights by {' or '.join(kind.weight_syncs)}, not "
                      f"train.weight_sync={cfg.train.weight_sync} (rollout/engines/kinds.py)",
                      f"set train.weight_sync={kind.weight_syncs[-1]} (or auto)")
    if r.elastic and cfg.cluster.colocate:
        yield Problem(("rollout.elastic", "cluster.colocate"), "colocated engines share the trainer's GPUs, so a "
                      "node that joins cannot get engines of their own",
                      "set cluster.colocate=false, or rollout.elastic=false")
    if kind.needs_gpu and cfg.cluster.gpus_per_node == 0:
        cpu_kinds = [k.name for k in ENGINE_KINDS.values() if not k.needs_gpu]
        yield Problem(("rollout.backend", "cluster.gpus_per_node"),
                      f"rollout={r.backend} needs GPUs but the cluster has cluster.gpus_per_node=0",
                      f"use rollout={cpu_kinds[0]} on a CPU machine, or a GPU cluster option (cluster=slurm_8xh100)")


def check_placement(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    c = cfg.cluster
    if c.colocate and cfg.rollout.num_gpus is not None and cfg.rollout.num_gpus != cfg.train.num_gpus:
        yield Problem(("cluster.colocate", "rollout.num_gpus", "train.num_gpus"),
                      f"colocated roles share the same GPUs, but rollout.num_gpus={cfg.rollout.num_gpus} and "
                      f"train.num_gpus={cfg.train.num_gpus}",
                      "set rollout.num_gpus=null (it follows train.num_gpus) or cluster.colocate=false")
    if c.nodes is not None and c.gpus_per_node > 0:
        yield Problem(("cluster.nodes", "cluster.gpus_per_node"),
                      f"cluster.nodes={c.nodes} is for CPU-only sites; with GPUs the node count is derived "
                      f"(here {d.nodes}: ceil({d.total_gpus} GPUs / cluster.gpus_per_node={c.gpus_per_node}))",
                      "remove cluster.nodes (set cluster.nodes=null)")
    elif (c.nodes or 1) > 1:
        if c.scheduler == "local":
            yield Problem(("cluster.nodes", "cluster.scheduler"),
                          f"cluster.nodes={c.nodes} spreads the run over several nodes, but cluster.scheduler=local "
                          "runs it on this machine",
                          "use a SLURM site (cluster=<site>), or cluster.nodes=null")
        if c.nodes > d.total_gpus:
            yield Problem(("cluster.nodes", "train.num_gpus", "rollout.num_gpus"),
                          f"cluster.nodes={c.nodes} nodes for {d.total_gpus} role processes: "
                          f"{c.nodes - d.total_gpus} node(s) would run nothing",
                          f"set cluster.nodes <= {d.total_gpus}, or give the roles more processes")
    if c.gpus_per_node > 0:
        if c.scheduler == "local" and d.total_gpus > c.gpus_per_node:
            role_sum = "max(train, rollout)" if c.colocate else "train + rollout"
            yield Problem(("train.num_gpus", "rollout.num_gpus", "cluster.gpus_per_node"),
                          f"{role_sum} = {d.total_gpus} GPUs do not fit this machine's cluster.gpus_per_node="
                          f"{c.gpus_per_node}",
                          "reduce train.num_gpus / rollout.num_gpus, set cluster.colocate=true, or use a SLURM cluster")
        if cfg.rollout.gpus_per_engine > c.gpus_per_node and cfg.rollout.gpus_per_engine % c.gpus_per_node:
            yield Problem(("rollout.gpus_per_engine", "cluster.gpus_per_node"),
                          f"an engine of {cfg.rollout.gpus_per_engine} GPUs cannot span whole nodes of "
                          f"{c.gpus_per_node} GPUs",
                          f"use a multiple or divisor of {c.gpus_per_node}")
        if cfg.train.tp > c.gpus_per_node:
            yield Problem(("train.tp", "cluster.gpus_per_node"),
                          f"train.tp={cfg.train.tp} spans nodes of {c.gpus_per_node} GPUs (TP needs NVLink)",
                          f"set train.tp <= {c.gpus_per_node} and use pp across nodes")
    if cfg.mode == "async" and c.colocate:
        yield Problem(("mode", "cluster.colocate"),
                      "async mode overlaps generation and training, which colocated roles cannot do",
                      "set cluster.colocate=false, or mode=sync")
    sync = cfg.train.weight_sync
    if sync == "tensor" and not c.colocate:
        yield Problem(("train.weight_sync", "cluster.colocate"),
                      "weight_sync=tensor hands tensors over on the same GPU and needs colocated roles",
                      "set train.weight_sync=distributed (or auto), or cluster.colocate=true")
    if sync == "distributed" and c.colocate:
        yield Problem(("train.weight_sync", "cluster.colocate"),
                      "weight_sync=distributed broadcasts between separate GPUs; colocated roles share theirs",
                      "set train.weight_sync=tensor (or auto)")
    if cfg.train.cuda_graphs and cfg.train.compile is False:
        yield Problem(("train.cuda_graphs", "train.compile"),
                      "CUDA graphs replay the compiled decoder layers, and train.compile=false compiles none",
                      "set train.compile=null (or true), or train.cuda_graphs=false")
    if cfg.train.cuda_graphs and c.colocate:
        yield Problem(("train.cuda_graphs", "cluster.colocate"),
                      "colocated, the trainer frees its bf16 compute copies every step, so the graphs (which hold "
                      "the parameters' addresses) would be recorded again every step",
                      "set train.cuda_graphs=false, or cluster.colocate=false")


def check_lengths(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    limit = cfg.model.max_position_embeddings
    if d.context_tokens > limit:
        yield Problem(("data.max_prompt_tokens", "rollout.max_response_tokens", "model.max_position_embeddings"),
                      f"prompt ({cfg.data.max_prompt_tokens}) + response ({cfg.rollout.max_response_tokens}) = "
                      f"{d.context_tokens} tokens exceed {cfg.model.name}'s context of {limit}",
                      f"lower rollout.max_response_tokens to {limit - cfg.data.max_prompt_tokens} or data.max_prompt_tokens"
                      if cfg.data.max_prompt_tokens < limit else f"lower data.max_prompt_tokens below {limit}")
    for i, ev in enumerate(cfg.data.eval):
        if ev.max_response_tokens is not None and cfg.data.max_prompt_tokens + ev.max_response_tokens > limit:
            yield Problem((f"data.eval.{i}.max_response_tokens", "model.max_position_embeddings"),
                          f"eval '{ev.name}': prompt + {ev.max_response_tokens} response tokens exceed {limit}",
                          f"lower data.eval.{i}.max_response_tokens")
    if cfg.algo.overlong_buffer_tokens >= cfg.rollout.max_response_tokens:
        yield Problem(("algo.overlong_buffer_tokens", "rollout.max_response_tokens"),
                      f"the overlong buffer ({cfg.algo.overlong_buffer_tokens} tokens) must be shorter than "
                      f"rollout.max_response_tokens={cfg.rollout.max_response_tokens}",
                      f"set algo.overlong_buffer_tokens < {cfg.rollout.max_response_tokens} (or 0 to disable)")


def check_algo(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    a = cfg.algo
    # check_objective says what algo.objective=sft refuses; algo=opd with reward_weight 0 leaves the estimator out
    rl = a.objective == "policy_gradient" or (a.distills and a.teacher.reward_weight > 0)
    group_based = rl and (a.advantage_estimator in GROUP_ESTIMATORS or a.dynamic_filter is not None)
    if group_based and cfg.rollout.n_samples_per_prompt < 2:
        why = f"advantage_estimator={a.advantage_estimator}" if a.advantage_estimator in GROUP_ESTIMATORS else (
            f"dynamic_filter={a.dynamic_filter}")
        yield Problem(("rollout.n_samples_per_prompt", "algo.advantage_estimator"),
                      f"{why} compares samples of one prompt, so it needs rollout.n_samples_per_prompt > 1 "
                      f"(got {cfg.rollout.n_samples_per_prompt})",
                      "set rollout.n_samples_per_prompt=8 (or more)")
    if group_based and cfg.rollout.temperature == 0 and cfg.rollout.n_samples_per_prompt > 1:
        yield Problem(("rollout.temperature", "algo.advantage_estimator"),
                      f"rollout.temperature=0 samples greedily, so the {cfg.rollout.n_samples_per_prompt} responses "
                      "of a prompt are the same and their group-relative advantages are 0: nothing is learned",
                      "set rollout.temperature=1.0 (or at least above 0)")
    if a.routing_replay and not cfg.model.is_moe:
        yield Problem(("algo.routing_replay", "model.num_experts"), f"routing replay replays the experts a MoE "
                      f"model's routers chose; model={cfg.model.name} is dense", "set algo.routing_replay=false")
    if a.routing_replay and not ENGINE_KINDS[cfg.rollout.backend].routed_experts:
        yield Problem(("algo.routing_replay", "rollout.backend"), f"rollout={cfg.rollout.backend} engines report no "
                      "routed experts through the router (sglang-router 0.3.2 drops return_routed_experts from the "
                      "/generate bodies it forwards)", f"use rollout="
                      f"{next(k.name for k in ENGINE_KINDS.values() if k.routed_experts)}, or set "
                      "algo.routing_replay=false")


def check_true_on_policy(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """algo.true_on_policy needs both sides batch-invariant (model/invariant.py) and nothing that computes a token
    otherwise: an engine kind and a train backend whose records say so, a dense model, no LoRA branch, nothing
    compiled."""
    if not cfg.algo.true_on_policy:
        return
    off = "or set algo.true_on_policy=false"
    engines = [k.name for k in ENGINE_KINDS.values() if k.batch_invariant]
    if not ENGINE_KINDS[cfg.rollout.backend].batch_invariant:
        yield Problem(("algo.true_on_policy", "rollout.backend"), f"rollout={cfg.rollout.backend} engines do not "
                      "compute tokens batch-invariantly", f"use rollout={engines[0]}, {off}")
    backends = [k.name for k in TRAIN_BACKEND_KINDS.values() if k.batch_invariant]
    kind = TRAIN_BACKEND_KINDS[cfg.train.backend]
    if not kind.batch_invariant:
        yield Problem(("algo.true_on_policy", "train.backend"), f"train={cfg.train.backend} has no batch-invariant "
                      "forward", f"use train={backends[0]}, {off}")
    for dim in (dim for dim in kind.parallelism if getattr(cfg.train, dim) > 1):
        yield Problem(("algo.true_on_policy", f"train.{dim}"), f"train.{dim}={getattr(cfg.train, dim)} splits "
                      "matmuls or attention over ranks, whose partial results are added in the collective's own "
                      "order (the batch-invariant forward covers one rank per replica: docs/loop.md)",
                      f"set train.{dim}=1, {off}")
    if cfg.model.is_moe:
        yield Problem(("algo.true_on_policy", "model.num_experts"), f"model={cfg.model.name} is a mixture of "
                      "experts, whose expert matmuls the batch-invariant forward does not cover", off)
    if cfg.train.lora.rank > 0:
        yield Problem(("algo.true_on_policy", "train.lora.rank"), "LoRA's adapter branch is a second matmul that the "
                      "engine's merged weights do not make", f"set train.lora.rank=0, {off}")
    for key, value in (("train.compile", cfg.train.compile), ("train.cuda_graphs", cfg.train.cuda_graphs)):
        if value:
            yield Problem(("algo.true_on_policy", key), "compiled kernels fuse operations and round otherwise than "
                          "the engine", f"set {key}=false, {off}")


def check_deterministic(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """deterministic=true: nothing that timing decides. Batch-invariant engines (what shares a batch changes no
    token), sync mode (a sync landing mid-rollout changes the weights of the requests after it), every prompt sent
    trained (over-sampling aborts the slowest groups), and on GPUs the batch-invariant trainer forward (both backends
    repeat their steps there under torch's deterministic algorithms: tests/loop/test_deterministic_gpu.py)."""
    if not cfg.deterministic:
        return
    off = "or set deterministic=false"
    if not ENGINE_KINDS[cfg.rollout.backend].batch_invariant:
        yield Problem(("deterministic", "rollout.backend"), f"rollout={cfg.rollout.backend} engines do not compute "
                      "tokens batch-invariantly", f"use rollout="
                      f"{next(k.name for k in ENGINE_KINDS.values() if k.batch_invariant)}, {off}")
    if cfg.mode != "sync":
        yield Problem(("deterministic", "mode"), "in async mode a weight sync lands mid-rollout, when timing says",
                      f"set mode=sync, {off}")
    over = cfg.rollout.over_sampling_batch_prompts
    if over is not None and over > cfg.rollout.batch_prompts:
        yield Problem(("deterministic", "rollout.over_sampling_batch_prompts"), "over-sampling aborts the groups that "
                      "finish last, which timing decides", f"set rollout.over_sampling_batch_prompts=null, {off}")
    if cfg.cluster.gpus_per_node and not cfg.algo.true_on_policy:
        yield Problem(("deterministic", "algo.true_on_policy", "cluster.gpus_per_node"), "on GPUs runs are shown to "
                      "repeat with the batch-invariant trainer only (tests/loop/test_deterministic_gpu.py); the "
                      "default one, compiled, is not yet shown to under torch's deterministic algorithms",
                      f"set algo.true_on_policy=true, {off}")


def check_paths(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """No path starts with '~': only a shell expands it (not YAML, nor a quoted override), and the run would make or
    look for a folder literally called '~' in the working directory."""
    paths = [("model.path", cfg.model.path), ("data.path", cfg.data.path), ("output_dir", cfg.output_dir),
             ("debug.rollout_path", cfg.debug.rollout_path), ("resume", cfg.resume)]
    paths += [(f"data.eval.{i}.path", e.path) for i, e in enumerate(cfg.data.eval)]
    for key, value in paths:
        if value is not None and value.startswith("~"):
            yield Problem((key,), f"{value!r} starts with '~', which nothing expands here",
                          f"write the path in full: {key}=$HOME{value[1:] if value.startswith('~/') else '/...'}")


def check_schedule(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """The learning-rate warmup ends inside the run (its optimizer steps: num_steps x optimizer_steps_per_rollout)."""
    total = cfg.num_steps * d.optimizer_steps_per_rollout
    if cfg.train.lr_warmup_steps >= total:
        yield Problem(("train.lr_warmup_steps", "num_steps"),
                      f"the warmup ({cfg.train.lr_warmup_steps} optimizer steps) does not end within the run's {total} "
                      f"(num_steps={cfg.num_steps} x {d.optimizer_steps_per_rollout} per rollout): the learning rate "
                      f"never reaches train.lr", f"set train.lr_warmup_steps below {total}, or raise num_steps")


def check_lora(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """train.lora options the model, the backend and the engines can honour."""
    lora = cfg.train.lora
    if not lora.enabled:
        return
    if cfg.model.spec.fused_gate_up and {"gate_proj", "up_proj"} & set(lora.target_modules):
        yield gate_up_problem()
    mlp = sorted({"gate_proj", "up_proj", "down_proj"} & set(lora.target_modules))
    if cfg.model.is_moe and mlp:
        yield Problem(("train.lora.target_modules", "model.family"),
                      f"model.family={cfg.model.family} holds its MLPs as routed experts in fused [experts, ...] "
                      f"tensors, not as the linears {mlp} PEFT adapts (it would skip them and train none)",
                      "adapt the attention: train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    if cfg.model.is_mla and {"q_proj", "k_proj", "v_proj"} & set(lora.target_modules):
        yield Problem(("train.lora.target_modules", "model.family"),
                      f"model.family={cfg.model.family} has multi-latent attention (q_a_proj, q_b_proj, "
                      "kv_a_proj_with_mqa, kv_b_proj), no q/k/v_proj for PEFT to adapt",
                      "adapt its output projection: train.lora.target_modules=[o_proj]")
    if d.lora_sync != "adapter":
        return
    if ENGINE_KINDS[cfg.rollout.backend].adapters == "directory" and d.weight_sync != "disk":
        yield Problem(("train.lora.sync", "train.weight_sync", "rollout.backend"),
                      f"train.lora.sync=adapter gives rollout={cfg.rollout.backend} engines the adapter as a directory "
                      f"they load (/load_lora_adapter), and train.weight_sync={cfg.train.weight_sync} sends tensors",
                      "set train.weight_sync=disk (or auto), or train.lora.sync=merged")
    if lora.bias != "none":
        yield Problem(("train.lora.sync", "train.lora.bias"),
                      f"train.lora.bias={lora.bias} trains biases, which the adapter alone does not carry to the "
                      "engines", "set train.lora.sync=merged (or auto), or train.lora.bias=none")


def check_tasks(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """The reward grades the environments in use, and a multi-turn task has its generate hook."""
    data, reward = cfg.data, cfg.reward.name
    if data.path is not None:
        used = []
    elif data.adaptive.enabled and data.adaptive.tasks:
        used = list(data.adaptive.tasks)
    else:
        used = [data.task] if data.task is not None else []
    envs = [t for t in used if t in MAX_LEVELS]
    if reward == "task" and (not used or len(envs) < len(used)):
        what = f"data.path={data.path}" if data.path is not None else f"data.task={data.task}"
        yield Problem(("reward.name", "data.task"),
                      f"reward=task is the score of a generated environment, but {what} is not one",
                      f"set data.task to one of {', '.join(MAX_LEVELS)}, or choose another reward (reward=math)")
    graders = set(REWARD_NAMES) - {"task", "random", "remote", "custom"}
    for t in envs:
        if reward in graders and reward not in get_env(t).graded_by:
            yield Problem(("reward.name", "data.task"),
                          f"reward={reward} cannot grade {t} (its own checker does: data/tasks/{t}.py)",
                          "set reward=task")
    hooks = [(t, get_env(t).generate_hook) for t in envs if get_env(t).generate_hook is not None]
    if hooks and cfg.rollout.generate is None:
        task, hook = hooks[0]
        yield Problem(("rollout.generate", "data.task"),
                      f"the {task} task is multi-turn: the model calls a tool, which the default generate does not run",
                      f"set rollout.generate={hook}")


def check_memory(cfg: SlimeConfig, d: Derived) -> Iterator[Problem]:
    """The memory plan fits the GPUs and the nodes' host RAM (config/memory.py)."""
    yield from memory_problems(cfg, d, plan_memory(cfg, d))


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending. sympy factorizes n (Pollard rho), so a hostile value (rollout.batch_prompts=
    99999999999999999999) costs milliseconds, where trying every k <= n never ends."""
    from sympy import divisors as sympy_divisors

    return sympy_divisors(n)


def _divisor_near(n: int, target: int) -> int:
    """The divisor of n closest to target (ties go to the smaller one)."""
    return min(divisors(n), key=lambda k: (abs(k - target), k))


RULES: tuple[Callable[[SlimeConfig, Derived], Iterator[Problem]], ...] = (
    check_batch, check_parallelism, check_backend, check_rollout, check_placement, check_lengths, check_algo,
    check_objective, check_true_on_policy, check_deterministic, check_tasks, check_lora, check_schedule, check_paths,
    check_memory,
)


def collect_problems(cfg: SlimeConfig) -> tuple[list[Problem], Derived | None]:
    """Every problem of the config, and the derived values when the counts allow computing them."""
    problems = [*domain_problems(cfg), *check_passthrough(cfg), *check_plugins(cfg)]
    known = (cfg.model.family in FAMILIES and cfg.train.backend in TRAIN_BACKEND_KINDS
             and cfg.rollout.backend in ENGINE_KINDS)  # an unknown kind is a domain problem already
    if not counts_hold(cfg) or not known:  # the rules divide by the counts and ask the kinds' records
        return problems, None
    layout = list(check_layout(cfg))
    if layout:  # ... and by dp
        return problems + layout, None
    derived = derive(cfg)
    for rule in RULES:
        problems.extend(rule(cfg, derived))
    return problems, derived


def validate(cfg: SlimeConfig) -> Derived:
    """Derived values of a valid config; raises ConfigError listing every problem otherwise."""
    problems, derived = collect_problems(cfg)
    if problems:
        raise ConfigError(problems)
    assert derived is not None
    return derived
