"""Configs that must fail do fail, before anything starts, with an error naming the right key and a fix."""

import pytest

from slime_hydra.config import ConfigError
from tests.config.helpers import load, problems

BIG = ("model=qwen3_8b", "model.path=/ckpt/qwen3_8b")  # heads 32, kv 8, layers 36, context 40960
GPU8 = ("cluster.gpus_per_node=8",)
AIR = ("model=glm4_5_air", "model.path=/ckpt/glm4_5_air")  # 128 experts, 8 per token, 1 group
DSV3 = ("model=deepseek_v3", "model.path=/ckpt/deepseek_v3")  # multi-latent attention, 128 heads

# (overrides, a key the error must name, a fragment of its message or fix)
INVALID = [
    # batch arithmetic
    (("train.global_batch_samples=100",), "train.global_batch_samples", "not a multiple"),
    (("train.global_batch_samples=128", "train.optimizer_steps_per_rollout=4"), "train.optimizer_steps_per_rollout",
     "= 512"),
    (("train.optimizer_steps_per_rollout=3",), "train.optimizer_steps_per_rollout", "3 equal optimizer steps"),
    (("train.global_batch_samples=512",), "train.global_batch_samples", "not a multiple"),
    # hostile sizes: the fix's divisor is found by factorizing, where trying every k <= 8e20 would never end
    (("rollout.batch_prompts=99999999999999999999", "train.global_batch_samples=7"), "train.global_batch_samples",
     "try train.global_batch_samples=6"),
    (("rollout.batch_prompts=99999999999999999999", "train.optimizer_steps_per_rollout=7"),
     "train.optimizer_steps_per_rollout", "try train.optimizer_steps_per_rollout=6"),
    (("train.micro_batch_samples=3",), "train.micro_batch_samples", "divisible by micro_batch_samples(3)"),
    (("train.num_gpus=3", "train.micro_batch_samples=1", "train.global_batch_samples=128"),
     "train.global_batch_samples", "dp(3)"),
    (("rollout.over_sampling_batch_prompts=16",), "rollout.over_sampling_batch_prompts", ">= 32"),
    (("rollout.max_filter_attempts=0",), "rollout.max_filter_attempts", "rollout.max_filter_attempts to a value > 0"),
    (("rollout.max_generate_retries=-1",), "rollout.max_generate_retries", "must be >= 0"),
    # mixture of experts
    (("model=tiny_moe", "model.moe_top_k=9"), "model.moe_top_k", "set model.moe_top_k <= 8"),
    (("model=tiny_moe", "model.moe_ffn_hidden_size=null"), "model.moe_ffn_hidden_size", "num_experts_per_tok"),
    (("model=tiny_moe", "model.num_experts=0"), "model.num_experts", "family=qwen3_moe is a mixture of experts"),
    (("model.num_experts=4",), "model.family", "family=qwen2 is dense"),
    (("algo.routing_replay=true",), "algo.routing_replay", "model=tiny is dense"),
    (("model=qwen3_30b_a3b", "model.path=/ckpt/qwen3_30b_a3b", *GPU8, "rollout=sglang", "algo.routing_replay=true"),
     "rollout.backend", "drops return_routed_experts"),
    (("model=tiny_moe", "train=megatron", "train.num_gpus=2", "train.pp=2", "train.micro_batch_samples=1",
      "train.gradient_checkpointing=true", "algo.routing_replay=true"), "train.gradient_checkpointing",
     "routes again in the backward"),
    # true on-policy: both sides batch-invariant, nothing that rounds otherwise
    ((*BIG, *GPU8, "algo.true_on_policy=true", "train=megatron", "train.num_gpus=2", "train.tp=2",
      "train.micro_batch_samples=1"), "train.tp", "set train.tp=1"),
    ((*DSV3, "algo.true_on_policy=true", "train=megatron"), "model.kv_lora_rank", "no batch-invariant form of "
     "multi-latent attention"),
    ((*BIG, *GPU8, "rollout=sglang", "algo.true_on_policy=true"), "rollout.backend", "use rollout=embedded"),
    (("algo.true_on_policy=true", "model=tiny_moe"), "model.num_experts", "mixture of experts"),
    (("algo.true_on_policy=true", "train.lora.rank=4"), "train.lora.rank", "set train.lora.rank=0"),
    (("algo.true_on_policy=true", "train.compile=true"), "train.compile", "set train.compile=false"),
    (("rollout.elastic=true", "cluster.colocate=true", "rollout.num_gpus=null"), "rollout.elastic",
     "set cluster.colocate=false"),
    # the fuzz test's find: a min_level above every level of a task without levels (addition) raised a KeyError
    (("data.adaptive.enabled=true", "data.adaptive.min_level=1000000000000000000"), "data.adaptive.enabled",
     "set data.task to one of"),
    # algo=sft: the data's responses, nothing sampled
    (("algo=sft",), "rollout.n_samples_per_prompt", "use recipes=tiny_sft_cpu"),
    (("recipes=tiny_sft_cpu", "algo.kl_loss_coef=0.01"), "algo.kl_loss_coef", "leave algo.kl_loss_coef at its default"),
    (("recipes=tiny_sft_cpu", "algo.policy_loss=gspo"), "algo.policy_loss", "leave algo.policy_loss at its default"),
    (("recipes=tiny_sft_cpu", "rollout.over_sampling_batch_prompts=96"), "rollout.over_sampling_batch_prompts",
     "set rollout.over_sampling_batch_prompts=null"),
    (("recipes=tiny_sft_cpu", "debug.mode=rollout_only"), "debug.mode", "set debug.mode=none"),
    # compiled layers under expert parallelism computed wrong gradients on an H200
    (("model=tiny_moe", "train=megatron", "train.num_gpus=2", "train.ep=2", "train.micro_batch_samples=32",
      "train.compile=true"), "train.compile", "set train.compile=null (eager under train.ep > 1)"),
    # algo=dpo: the data's pairs
    (("algo=dpo",), "rollout.n_samples_per_prompt", "set rollout.n_samples_per_prompt=2"),
    (("recipes=tiny_dpo_cpu", "algo.loss_agg=token_mean"), "algo.loss_agg", "set algo.loss_agg=seq_mean_token_sum"),
    (("recipes=tiny_dpo_cpu", "train.optimizer_steps_per_rollout=2"), "train.optimizer_steps_per_rollout",
     "one optimizer step a batch"),
    (("recipes=tiny_dpo_cpu", "algo.kl_loss_coef=0.01"), "algo.kl_loss_coef", "leave algo.kl_loss_coef at its"),
    (("algo.dpo.beta=0.5",), "algo.dpo", "set algo.objective=dpo (algo=dpo)"),
    (("recipes=tiny_dpo_cpu", "algo.dpo.beta=0"), "algo.dpo.beta", "must be positive"),
    # algo=opd: a teacher, and only there
    (("algo=opd",), "algo.teacher.path", "set algo.teacher.path=<HF checkpoint dir> or a conf/model option"),
    (("algo.teacher.path=tiny_teacher",), "algo.teacher", "set algo.objective=opd (algo=opd)"),
    (("recipes=tiny_sft_cpu", "algo.teacher.kl_coef=0.5"), "algo.teacher", "objective=sft has no teacher"),
    (("recipes=tiny_opd_cpu", "algo.teacher.reward_weight=1", "rollout.n_samples_per_prompt=1"),
     "rollout.n_samples_per_prompt", "needs rollout.n_samples_per_prompt > 1"),
    # deterministic: nothing that timing decides
    (("deterministic=true", "mode=async"), "mode", "set mode=sync"),
    (("deterministic=true", "rollout.over_sampling_batch_prompts=64"), "rollout.over_sampling_batch_prompts",
     "aborts the groups that finish last"),
    ((*BIG, *GPU8, "rollout=sglang", "deterministic=true"), "rollout.backend", "use rollout=embedded"),
    ((*BIG, *GPU8, "deterministic=true"), "algo.true_on_policy", "set algo.true_on_policy=true"),
    # the grouped router (glm4_moe, deepseek_v3) and its megatron mapping
    ((*AIR, "model.moe_groups=3"), "model.moe_groups", "does not split num_experts=128"),
    ((*AIR, "model.moe_groups=128"), "model.moe_groups", "two best experts"),
    ((*AIR, "model.moe_group_top_k=2"), "model.moe_group_top_k", "set model.moe_group_top_k <= 1"),
    ((*AIR, "model.moe_groups=64", "model.moe_group_top_k=2"), "model.moe_top_k", "hold 4"),
    ((*AIR, "model.first_dense_layers=46"), "model.first_dense_layers", "leaves no MoE layer"),
    (("model=qwen3_30b_a3b", "model.path=/ckpt", "model.moe_shared_experts=1"), "model.moe_shared_experts",
     "family=qwen3_moe has no shared experts"),
    ((*AIR, "train=megatron", "model.moe_groups=8", "model.moe_group_top_k=2", "train.micro_batch_samples=1"),
     "model.moe_groups", "scores a group by its best 4 experts"),
    # multi-latent attention (deepseek_v3)
    ((*DSV3, "model.head_dim=128"), "model.head_dim", "set model.head_dim=null"),
    ((*DSV3, "model.v_head_dim=null"), "model.v_head_dim", "needs v_head_dim"),
    ((*DSV3, "model.num_kv_heads=8"), "model.num_kv_heads", "set model.num_kv_heads=128"),
    ((*AIR, "model.kv_lora_rank=512"), "model.kv_lora_rank", "family=glm4_moe has no multi-latent attention"),
    ((*DSV3, *GPU8, "train=megatron", "train.num_gpus=8", "train.tp=8", "model.kv_lora_rank=510",
      "train.micro_batch_samples=1"), "model.kv_lora_rank", "574 rows, not divisible by train.tp=8"),
    ((*DSV3, "train.lora.rank=8", "train.lora.target_modules=[q_proj,o_proj]"), "train.lora.target_modules",
     "no q/k/v_proj"),
    ((*DSV3, "train=megatron", "train.lora.rank=8", "train.lora.target_modules=[o_proj]"), "train.lora.rank",
     "LoRA on multi-latent attention is not built for train=megatron"),
    # parallelism
    ((*BIG, "train=megatron", "train.num_gpus=6", "train.tp=4"), "train.num_gpus", "multiple of 4"),
    ((*BIG, "train=megatron", "train.num_gpus=3", "train.tp=3", "train.micro_batch_samples=1"),
     "model.num_attention_heads", "choose train.tp among"),
    ((*BIG, "train=megatron", "train.num_gpus=16", "train.tp=16", "cluster.gpus_per_node=16",
      "train.micro_batch_samples=1"), "model.num_kv_heads", "[1, 2, 4, 8]"),
    ((*BIG, "train=megatron", "train.num_gpus=8", "train.pp=8", "train.micro_batch_samples=1"), "train.pp",
     "not divisible by train.pp=8"),
    ((*BIG, "train.num_gpus=2", "train.tp=2"), "train.backend", "use train=megatron"),
    ((*BIG, "train.num_gpus=2", "train.cp=2"), "train.cp", "does not split a model replica by cp=2"),
    ((*BIG, "train=megatron", "train.num_gpus=6", "train.tp=2", "train.cp=2", "train.micro_batch_samples=1"),
     "train.cp", "tp(2) x pp(1) x cp(2) = 4"),
    ((*BIG, "train=megatron", "train.num_gpus=8", "train.pp=8", "train.micro_batch_samples=1",
      "+train.megatron.num_layers_in_first_pipeline_stage=10"), "train.megatron.num_layers_in_first_pipeline_stage",
     "leave 26 layers for 7 stages"),
    ((*BIG, "train=megatron", "train.ep=2", "train.num_gpus=2", "train.micro_batch_samples=1"), "train.ep",
     "needs a MoE model"),
    ((*BIG, "train=megatron", "train.num_gpus=16", "train.tp=16", "train.micro_batch_samples=1", *GPU8,
      "cluster=slurm"), "train.tp", "spans nodes"),
    # rollout engines
    ((*BIG, "rollout.num_gpus=3", "rollout.gpus_per_engine=2"), "rollout.gpus_per_engine", "multiple of 2"),
    ((*BIG, "rollout.num_gpus=3", "rollout.gpus_per_engine=3"), "rollout.gpus_per_engine", "does not divide"),
    (("rollout=sglang",), "cluster.gpus_per_node", "use rollout=embedded"),
    (("run_name=a/b",), "run_name", "not a plain directory name"),
    (("run_name=..",), "run_name", "not a plain directory name"),
    (("run_name=exp%j",), "run_name", "not a plain directory name"),
    ((*BIG, *GPU8, "rollout.num_gpus=2", "rollout.gpus_per_engine=2"), "rollout.gpus_per_engine",
     "rollout=embedded runs on at most 1 GPU"),
    ((*BIG, *GPU8, "rollout=sglang", "cluster.colocate=true", "rollout.num_gpus=null", "train.weight_sync=tensor"),
     "train.weight_sync", "set train.weight_sync=disk"),
    (("rollout.num_gpus=null",), "rollout.num_gpus", "cluster.colocate=true"),
    (("rollout.generate=mygenerate",), "rollout.generate", "dotted path"),
    # placement
    (("cluster.colocate=true", "rollout.num_gpus=2"), "cluster.colocate", "share the same GPUs"),
    ((*BIG, *GPU8, "train.num_gpus=6", "rollout.num_gpus=4", "train.micro_batch_samples=1"), "cluster.gpus_per_node",
     "do not fit"),
    (("mode=async", "cluster.colocate=true", "rollout.num_gpus=null"), "mode", "cannot do"),
    ((*BIG, "cluster=slurm", "cluster.nodes=2"), "cluster.nodes", "the node count is derived (here 1: ceil("),
    (("cluster.nodes=2",), "cluster.nodes", "use a SLURM site"),
    (("cluster=ci_two_node", "cluster.nodes=3"), "cluster.nodes", "1 node(s) would run nothing"),
    (("train.weight_sync=tensor",), "train.weight_sync", "needs colocated"),
    (("train.cuda_graphs=true", "train.compile=false"), "train.cuda_graphs", "set train.compile=null"),
    (("train.cuda_graphs=true", "cluster.colocate=true", "rollout.num_gpus=null"), "train.cuda_graphs",
     "recorded again every step"),
    (("train.weight_sync=distributed", "cluster.colocate=true", "rollout.num_gpus=null"), "train.weight_sync",
     "share theirs"),
    # lengths
    (("rollout.max_response_tokens=512",), "rollout.max_response_tokens", "exceed tiny's context of 256"),
    ((*BIG, "data.max_prompt_tokens=40000", "rollout.max_response_tokens=4096"), "data.max_prompt_tokens",
     "exceed qwen3_8b's context"),
    (("algo=dapo",), "algo.overlong_buffer_tokens", "shorter than"),
    # algorithm
    (("rollout.n_samples_per_prompt=1",), "rollout.n_samples_per_prompt", "needs rollout.n_samples_per_prompt > 1"),
    (("algo=reinforce_pp_baseline", "rollout.n_samples_per_prompt=1"), "rollout.n_samples_per_prompt", "> 1"),
    (("algo.kl_loss_coef=0.001", "algo.kl_coef=0.01"), "algo.kl_loss_coef", "mutually exclusive"),
    (("algo.eps_clip_c=0.5",), "algo.eps_clip_c", "must be > 1"),
    (("algo.tis_cap=0.5",), "algo.tis_cap", ">= 1"),
    (("algo.policy_loss=gspo",), "algo.loss_agg", "seq_mean_token_mean"),
    (("algo.dynamic_filter=allsame",), "algo.dynamic_filter", "nonzero_std"),
    (("algo.gamma=1.5",), "algo.gamma", "[0, 1]"),
    # choices, with the nearest valid name
    (("algo.advantage_estimator=grop",), "algo.advantage_estimator", "did you mean algo.advantage_estimator=grpo"),
    (("algo.loss_agg=token_means",), "algo.loss_agg", "token_mean"),
    (("train.weight_sync=nccl",), "train.weight_sync", "choose one of"),
    (("mode=asynchronous",), "mode", "async"),
    # counts
    (("rollout.batch_prompts=0",), "rollout.batch_prompts", "must be positive"),
    (("train.num_gpus=-1",), "train.num_gpus", "must be positive"),
    (("train.global_batch_samples=0",), "train.global_batch_samples", "positive or null"),
    (("num_steps=0",), "num_steps", "must be positive"),
    (("save_every_steps=-5",), "save_every_steps", ">= 0"),
    # sources and required values
    (("data.task=null",), "data.path", "both data.path and data.task are null"),
    (("data.path=/data/train.csv",), "data.path", "JSONL or Parquet"),
    (("data.task=adition",), "data.task", "did you mean data.task=addition"),
    (("model=glm4_9b",), "model.path", "HF checkpoint directory"),
    (("model=small", "model.vocab_size=200"), "model.vocab_size", "at least 261"),
    (("model.vocab_size=64",), "model.vocab_size", "character tokenizer has 101 tokens"),
    (("model.tokenizer=wordpiece",), "model.tokenizer", "one of char, bpe"),
    (("model.tokenizer=null",), "model.path", "only model=tiny and model=small are built offline"),
    (("reward=remote",), "reward.url", "needs an http(s) URL"),
    (("reward=custom", "reward.target=score"), "reward.target", "dotted path"),
    (("debug=train_only",), "debug.rollout_path", "trains from saved rollouts"),
    (("data.row_start=10", "data.row_end=5"), "data.row_end", "after row_start"),
    # generated environments and adaptive difficulty
    (("data.task=countdwn",), "data.task", "did you mean data.task=countdown"),
    (("data=countdown",), "reward.name", "set reward=task"),
    (("data=sorting", "reward=math"), "reward.name", "cannot grade sorting"),
    (("reward=task",), "reward.name", "set data.task to one of arithmetic"),
    (("data=calculator", "reward=task"), "rollout.generate", "rollout.generate=slime_hydra.rollout.examples.calculator_tool.calculator"),
    (("data=arithmetic", "data.level=9"), "data.level", "between 1 and 8"),
    (("data.level=2",), "data.level", "without levels"),
    (("data.adaptive.enabled=true",), "data.task", "needs an environment with levels"),
    (("data=jsonl", "data.path=/data/train.jsonl", "data.adaptive.enabled=true"), "data.path", "set data.path=null"),
    (("data=arithmetic", "data.adaptive.enabled=true", "data.adaptive.band_low=0.7"), "data.adaptive.band_low",
     "must be below band_high=0.7"),
    (("data=arithmetic", "data.adaptive.band_high=1.5"), "data.adaptive.band_high", "in [0, 1]"),
    (("data=arithmetic", "data.adaptive.window_groups=0"), "data.adaptive.window_groups", "must be positive"),
    (("data=arithmetic", "data.adaptive.min_level=4", "data.adaptive.max_level=3"), "data.adaptive.max_level",
     "below min_level=4"),
    (("data=arithmetic", "data.adaptive.start_level=5", "data.adaptive.max_level=3"), "data.adaptive.start_level",
     "outside [min_level=1, max_level=3]"),
    (("data=arithmetic", "data.adaptive.enabled=true", "data.adaptive.tasks=[sortng]"), "data.adaptive.tasks.0",
     "did you mean sorting"),
    (("data=arithmetic", "data.adaptive.enabled=true", "data.adaptive.min_level=7", "data.adaptive.tasks=[countdown]",
      "reward=task"), "data.adaptive.min_level", "countdown (5)"),
    # unknown keys: typos, and keys added with + / ++ under our groups
    (("rollout.temprature=0.7",), "rollout.temprature", "did you mean 'rollout.temperature'"),
    (("+rollout.temprature=0.7",), "rollout.temprature", "did you mean 'rollout.temperature'"),
    (("++train.learning_rate=1e-5",), "train.learning_rate", "unknown key"),
    (("+algo.kl_los_coef=0.1",), "algo.kl_los_coef", "did you mean 'algo.kl_loss_coef'"),
    (("+num_step=5",), "num_step", "did you mean 'num_steps'"),
    (("data.eval.0.temprature=1.0",), "data.eval.0.temprature", "did you mean 'data.eval.0.temperature'"),
    # passthrough options: unknown names and options the platform owns
    (("rollout=sglang", *GPU8, "+rollout.sglang.mem_fraction_statc=0.5"), "rollout.sglang.mem_fraction_statc",
     "did you mean rollout.sglang.mem_fraction_static"),
    (("rollout=sglang", *GPU8, "+rollout.sglang.tp_size=2"), "rollout.sglang.tp_size", "rollout.gpus_per_engine"),
    (("rollout=sglang", *GPU8, "+rollout.sglang.model_path=/x"), "rollout.sglang.model_path", "use model.path"),
    (("train=megatron", "+train.megatron.recompute_granularty=full"), "train.megatron.recompute_granularty",
     "did you mean train.megatron.recompute_granularity"),
    (("train=megatron", "+train.megatron.tensor_model_parallel_size=2"), "train.megatron.tensor_model_parallel_size",
     "use train.tp"),
    (("train=megatron", "+train.megatron.num_query_groups=2"), "train.megatron.num_query_groups",
     "use model.num_kv_heads"),
    (("train=megatron", "+train.megatron.micro_batch_size=2"), "train.megatron.micro_batch_size",
     "not a field of megatron-core TransformerConfig"),
    (("train=megatron", "+train.megatron.decoder_first_pipeline_num_layers=2"),
     "train.megatron.decoder_first_pipeline_num_layers", "not a field of megatron-core TransformerConfig"),
    (("train=megatron", "+train.megatron.recompute_granularity=partial"), "train.megatron.recompute_granularity",
     "one of ['full', 'selective']"),
    (("train=megatron", "+train.megatron.sequence_parallel=1"), "train.megatron.sequence_parallel", "true or false"),
    (("train=megatron", "+train.megatron.init_method=x"), "train.megatron.init_method", "not settable from a config"),
    (("+train.megatron.recompute_granularity=full",), "train.megatron", "use train=megatron"),
    # plug-ins: imported and their signatures checked at validation
    (("reward=custom", "reward.target=no_such_module.score"), "reward.target", "cannot be imported"),
    (("reward=custom", "reward.target=slime_hydra.reward.exact_match.nothing"), "reward.target", "cannot be imported"),
    (("reward=custom", "reward.target=slime_hydra.reward.registry.NAMES"), "reward.target", "not a callable"),
    (("reward=custom", "reward.target=slime_hydra.reward.registry.scalar_reward"), "reward.target",
     "cannot take 3 positional arguments"),
    (("rollout.generate=os.path.nothing",), "rollout.generate", "cannot be imported"),
    (("rollout.generate=slime_hydra.rollout.generate.apply_output",), "rollout.generate", "is not async"),
    (("algo.dynamic_filter=slime_hydra.buffer.filters.filter_name", "rollout.n_samples_per_prompt=8",
      "algo.dynamic_filter=os.getcwd"), "algo.dynamic_filter", "cannot take 1 positional argument"),
    (("cluster=slurm", "cluster.job_body=slime_hydra.nothing.run"), "cluster.job_body", "cannot be imported"),
    # what would escape its place: an sbatch line break, a run directory outside output_dir
    (("cluster=slurm", "cluster.sbatch_extra=['--x=1\n#SBATCH --y']"), "cluster.sbatch_extra", "spans lines"),
    (("model.name=../../etc", "model.path=/tmp"), "model.name", "not a plain name"),
    # what a backend would refuse at start-up
    (("model=tiny_moe", "train=megatron", "train.ep=4", "train.num_gpus=4", "train.pp=2",
      "train.micro_batch_samples=1"), "train.ep", "data-parallel size (2) x train.cp (1)"),
    (("model=tiny_moe", "train=megatron", "train.ep=4", "train.num_gpus=2", "train.micro_batch_samples=1"),
     "train.ep", "data-parallel size (2"),
    (("model=qwen3_30b_a3b", "model.path=/ckpt", "train.ep=2", "train.num_gpus=2", "train.micro_batch_samples=1"),
     "train.ep", "does not split a model replica by ep=2"),
    (("train=megatron", "train.gradient_checkpointing=true"), "train.gradient_checkpointing", "CUDA RNG"),
    (("train=megatron", "train.num_gpus=3", "train.tp=3", "model.num_attention_heads=6", "model.num_kv_heads=3",
      "train.micro_batch_samples=1", "train.global_batch_samples=3", "rollout.batch_prompts=3",
      "rollout.n_samples_per_prompt=2", "train.optimizer_steps_per_rollout=2"), "model.vocab_size", "divisible"),
    (("train=megatron", "train.tp=2"), "train.num_gpus", "multiple of 2"),  # was a ZeroDivisionError
    (("train=megatron", "train.num_gpus=2", "train.pp=2", "train.pack_sequences=true"), "train.pack_sequences",
     "cp=1, pp=1"),
    ((*DSV3, "train=megatron", "train.pack_sequences=true"), "train.pack_sequences", "multi-latent attention"),
    (("train=megatron", "train.num_gpus=2", "train.tp=2", "+train.megatron.sequence_parallel=true",
      "train.pack_sequences=true"), "train.megatron.sequence_parallel", "with sequence_parallel"),
    # ranges on the field
    (("rollout.temperature=-0.5",), "rollout.temperature", ">= 0"),
    (("rollout.top_p=0",), "rollout.top_p", "in (0, 1]"),
    (("rollout.top_k=0",), "rollout.top_k", "-1 (off) or a value >= 1"),
    (("train.adam_beta2=1.0",), "train.adam_beta2", "in [0, 1)"),
    (("data.eval.0.temperature=-1",), "data.eval.0.temperature", ">= 0"),
    (("reward.timeout_s=0",), "reward.timeout_s", "positive"),
    (("algo.mis_cap=1.0",), "algo.mis_cap", "> 1"),
]


@pytest.mark.parametrize("overrides,key,fragment", INVALID, ids=[" ".join(o) for o, _, _ in INVALID])
def test_invalid_config_names_key_and_fix(overrides, key, fragment):
    error = problems(*overrides)
    matching = [p for p in error.problems if key in p.keys]
    assert matching, f"no problem names {key}:\n{error}"
    assert any(fragment in f"{p.message}; {p.fix}" for p in matching), f"'{fragment}' not in:\n{error}"


def test_true_on_policy_validates_with_megatron_at_one_rank_per_replica():
    cfg, _ = load("algo.true_on_policy=true", "train=megatron")
    assert cfg.algo.true_on_policy and cfg.train.tp == 1


def test_deterministic_validates_on_gpus_with_a_backend_that_repeats_its_steps_there():
    cfg, _ = load(*BIG, *GPU8, "train=fsdp", "deterministic=true", "algo.true_on_policy=true", "cluster.mem_gb=1000")
    assert cfg.deterministic and cfg.cluster.gpus_per_node == 8


@pytest.mark.parametrize("parallel", [("train.pp=2", "train.ep=2"), ("train.cp=2", "train.ep=4"),
                                      ("train.cp=2", "train.pp=2", "train.ep=2"),
                                      ("train.pp=2", "+train.megatron.moe_aux_loss_coeff=0.01")], ids=" ".join)
def test_moe_with_pipeline_and_context_parallelism_validates(parallel):
    """EP peers are the data- and context-parallel ranks of one pipeline stage: ep must divide dp x cp (4 ranks:
    EP2 x PP2 has dp 2, EP4 x CP2 dp 2 x cp 2, EP2 x CP2 x PP2 dp 1 x cp 2); the load-balancing loss runs with PP."""
    cfg, _ = load("model=tiny_moe", "train=megatron", "train.micro_batch_samples=1", "train.num_gpus=4", *parallel)
    assert cfg.train.pp * cfg.train.cp > 1


def test_table_is_large():
    assert len(INVALID) >= 30


def test_all_problems_reported_at_once():
    error = problems("rollout.n_samples_per_prompt=1", "algo.kl_loss_coef=0.001", "algo.kl_coef=0.1", "train.micro_batch_samples=3",
                     "rollout.max_response_tokens=500", "algo.eps_clip_c=0.9")
    named = {k for p in error.problems for k in p.keys}
    assert {"rollout.n_samples_per_prompt", "algo.kl_coef", "train.micro_batch_samples",
            "rollout.max_response_tokens", "algo.eps_clip_c"} <= named
    assert str(error).startswith(f"{len(error.problems)} config problems:")


def test_group_option_typo_fails_at_composition():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="qwen3_9b"):
        problems("model=qwen3_9b")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_layers_compile_on_cuda_by_default_but_not_under_expert_parallelism():
    """train.compile=null: compiled on CUDA, eager on CPU and, since the compiled EP2 step's gradients were wrong on
    an H200 (docs/benchmarks.md), eager under train.ep > 1; an explicit value is kept (EP > 1 refuses true)."""
    from slime_hydra.train.config import TrainConfig

    assert [TrainConfig(ep=ep).compiles(device) for ep in (1, 2) for device in ("cuda", "cpu")] == [
        True, False, False, False]
    assert TrainConfig(compile=True).compiles("cpu") and not TrainConfig(compile=False).compiles("cuda")
    cfg, _ = load("model=tiny_moe", "train=megatron", "train.num_gpus=2", "train.ep=2", "train.micro_batch_samples=32")
    assert cfg.train.compile is None
