#!/usr/bin/env bash
# The RL loop on GPUs, for speed (not learning): a random-init checkpoint of MODEL (default qwen2_5_0_5b; with the
# tiny character tokenizer, so no download; bf16 for models other than the 0.5B) trained with GRPO on the addition
# task for a few steps.
#   bash scripts/bench_loop_gpu.sh colocated      # one GPU: trainer and engine take turns, CUDA IPC weight sync
#   bash scripts/bench_loop_gpu.sh disaggregated  # two GPUs: trainer on one, engine on the other, NCCL broadcast
#   bash scripts/bench_loop_gpu.sh colocated save_every_steps=2   # more overrides after the mode
#   MODEL=qwen2_5_7b bash scripts/bench_loop_gpu.sh colocated train.lora.rank=32   # LoRA on a 7B shape
#   TEACHER=qwen2_5_7b bash scripts/bench_loop_gpu.sh colocated   # algo=opd: a random teacher of that shape (bf16)
# Prints the per-phase step times from metrics.jsonl (docs/benchmarks.md records them).
set -euo pipefail
mode=${1:-colocated}
model=${MODEL:-qwen2_5_0_5b}
out=${OUT:-/tmp}/loop_${mode}${RUN_TAG:+_$RUN_TAG}
ckpt=/tmp/${model}_random
build() {  # a random-init checkpoint of model option $2 at $1, with the tiny tokenizer
python3 - "$1" "$2" <<'PY'
import sys
from pathlib import Path
import torch
from slime_hydra.config import compose, to_config
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.model.tiny import build_tiny_tokenizer
out, name = Path(sys.argv[1]), sys.argv[2]
if not (out / "config.json").exists():
    tok = build_tiny_tokenizer()
    model = to_config(compose([f"model={name}"])).model
    build_random_checkpoint(model, out, dtype=torch.float32 if name == "qwen2_5_0_5b" else torch.bfloat16,
                            tokenizer=tok, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            bos_token_id=None)
PY
}
build "$ckpt" "$model"
teacher=()
if [ -n "${TEACHER:-}" ]; then
  build "/tmp/${TEACHER}_random" "$TEACHER"
  teacher=(algo=opd algo.teacher.path=/tmp/${TEACHER}_random)
fi
common=(model=$model model.path=$ckpt cluster.gpus_per_node=$([ "$mode" = colocated ] && echo 1 || echo 2)
        train.num_gpus=1 train.dtype=bf16 train.lr=1e-6 train.micro_batch_samples=32 num_steps=6
        rollout.batch_prompts=32 rollout.n_samples_per_prompt=8 rollout.max_response_tokens=128
        rollout.temperature=1.0 rollout.eval_every_steps=0 output_dir=$out run_name=run tracking.progress=false)
if [ "$mode" = colocated ]; then
  args=(cluster.colocate=true rollout.num_gpus=null train.weight_sync=tensor)
else
  args=(rollout.num_gpus=1 train.weight_sync=distributed)
fi
rm -rf "$out"  # a fresh run: the same run_name in an existing folder would resume its checkpoint instead
python3 launch.py "${common[@]}" "${args[@]}" "${teacher[@]}" "${@:2}" || {
  status=$?  # what the engines and the router said (their logs stay on the machine)
  grep -H -i -A12 "error\|traceback" "$out"/run/logs/engine_*.log | head -80  # the engines' first, the cause
  grep -H -i "error" "$out"/run/logs/router.log | tail -5
  exit $status
}
python3 - "$out/run/metrics.jsonl" "$([ "$mode" = colocated ] && echo 1 || echo 2)" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "perf/step_time" in l]
keys = ["perf/step_time", "perf/rollout_time", "perf/logprobs_time", "perf/teacher_time", "perf/train_time",
        "perf/weight_sync_time", "train/opd_reverse_kl",
        "perf/offload_time", "perf/offload_trainer_offload_time", "perf/offload_engine_resume_time",
        "perf/offload_engine_release_time", "perf/offload_trainer_onload_time", "perf/offload_release_and_onload_time",
        "perf/checkpoint_time", "perf/overhead_time", "perf/tokens_per_s", "rollout/tokens", "sync/bytes",
        "perf/trainer_gpu_gb_engines", "perf/trainer_gpu_gb_trainer", "perf/trainer_gpu_peak_gb",
        "train/train_rollout_logprob_abs_diff", "rollout/weight_version_lag",
        "rollout/engine_gpu_peak_gb"]
for r in rows:
    print(r["step"], " ".join(f"{k.split('/')[-1]}={r.get(k, float('nan')):.4g}" for k in keys))
# over every step (the last one's time includes the final checkpoint): mean, median, min
gpus = int(sys.argv[2])
times = [r["perf/step_time"] for r in rows]
per_gpu = [r["rollout/tokens"] / r["perf/step_time"] / gpus for r in rows]
gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
print(f"all {len(rows)} steps: step_time mean {statistics.fmean(times):.3f} median {statistics.median(times):.3f} "
      f"min {min(times):.3f} s; response tokens/s/GPU mean {statistics.fmean(per_gpu):.0f} "
      f"median {statistics.median(per_gpu):.0f} max {max(per_gpu):.0f}; logprob abs diff mean "
      f"{statistics.fmean(gaps) if gaps else float('nan'):.5f}; weight_version_lag max "
      f"{max(r['rollout/weight_version_lag'] for r in rows):.0f}")
PY
