"""The RL loop: generate -> score -> filter -> train -> sync -> track -> checkpoint -> eval, every rollout step
(algo=sft: the data's responses in place of generate -> score -> filter, their NLL the loss; docs/loop.md).

    run(cfg, run_dir)          what ``python launch.py`` does after validation (and a SLURM job on its rank 0)

Who does what (docs/architecture.md has the whole map):

- Ray places one bundle per GPU (``{GPU: 1, CPU: 1}``; ``{CPU: 1}`` per role process on a CPU-only machine).
  Training ranks take the first ``train.num_gpus`` bundles; engines take the next ``rollout.num_gpus``
  (disaggregated) or share the training bundles (``cluster.colocate``).
- ``TrainGroup`` (train/group.py): the rank actors, one torch.distributed group, the backend (+ PPO's critic; the
  teacher of algo=opd, frozen, in the same ranks).
- ``RolloutManager`` (rollout/manager.py), an async Ray actor: router, engines, prompt source, buffer, rewards,
  eval sets. ``generate_batch`` returns a full training batch of scored, filtered samples.
- Weight sync (train/weight_sync.py): every ``sync_every_steps`` steps the trainer pushes its weights to the
  engines as version = rollout steps trained.

One step in sync mode: the engines generate a batch with the current weights; the trainer computes old (and reference)
logprobs, the teacher's (algo=opd), advantages, then takes ``optimizer_steps_per_rollout`` optimizer steps on
consecutive ``global_batch_samples`` slices; the new weights go to the engines. In async mode (``mode=async``, roles on
separate GPUs) the rollouts of the next ``max_staleness`` steps (one at least) start before step k trains, one after
another on the weights the engines hold then: samples lag the policy by at most ``max_staleness`` versions
(``rollout/weight_version_lag``; the buffer drops older groups), a sync that arrives mid-rollout is applied in place,
and TIS (``algo.tis_cap``) corrects the mixed logprobs with the behaviour logprobs.

Colocated on GPUs (``cluster.colocate``), trainer and engines take turns with the GPU memory (turns.py), unless the
memory plan fits both on one GPU together (``cluster.colocate_offload``, config/memory.py). Steps count from 1: the k-th
step's metrics are row k of metrics.jsonl, its weights version k, its checkpoint step_k; row 0 is the eval before
training. Every phase runs inside ``timer.phase(<name>)`` (tracking/phases.py: ``perf/<name>_time`` in s,
``perf/step_time``, ``perf/overhead_time``, ``perf/step_tokens_per_s``).

Checkpoints (checkpoint.py): every ``save_every_steps`` steps or ``save_every_minutes``, at the end, and on SIGTERM,
SIGUSR1 or SIGUSR2 (preempt.py: the step in progress finishes and is saved, ``run`` returns ``"preempted"``). The
trainer ranks write theirs in the background; ``latest`` moves at a later step boundary, once every file is on disk.
``resume=auto`` continues from the newest intact one: trainer state, prompt cursor, buffer, tracking step and
(async mode) the rollouts started ahead.

Between steps the driver answers requests to add, remove or list engines (``python -m slime_hydra.engines``). Debug
modes (``debug.mode``): ``rollout_only`` generates and scores and never trains; ``train_only`` trains from the batches
an earlier run saved (``debug.save_rollouts``, ``debug.rollout_path``) and starts no engine.
"""

import json
import os
import socket
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from slime_hydra import preempt
from slime_hydra.buffer.rollout_files import load_saved_rollout, save_rollout
from slime_hydra.buffer.sample import Sample
from slime_hydra.checkpoint import RUN_RECORD, Checkpoints, export_dir
from slime_hydra.durable import write_json
from slime_hydra.cluster.local_ray import LocalRay, connect, death_report
from slime_hydra.cluster.ray_cluster import placement_bundles
from slime_hydra.config.derive import Derived, bundle_nodes, derive
from slime_hydra.config.memory import plan_memory
from slime_hydra.config.schema import SlimeConfig
from slime_hydra.cores import usable_cores
from slime_hydra.dotted import import_callable
from slime_hydra.model.hf import copy_tokenizer, load_tokenizer
from slime_hydra.rollout import engine_requests
from slime_hydra.rollout.engines.kinds import ENGINE_KINDS
from slime_hydra.model.teacher import resolve_teacher
from slime_hydra.model.warm_start import resolve_model_path
from slime_hydra.stall import PROBE_TIMEOUT_S, StallDoctor, StallError
from slime_hydra.tracking.phases import WAITS_ON, StepTimer
from slime_hydra.tracking.progress import ProgressView
from slime_hydra.tracking.tracker import Tracker
from slime_hydra.train.objectives import CriticLoss, actor_loss
from slime_hydra.train.prepare import add_advantages, held_out_losses, needs_old_logprobs, to_train_batch
from slime_hydra.turns import GpuTurns

if TYPE_CHECKING:
    from slime_hydra.train.group import TrainGroup  # imported where the trainer starts: the driver may run none

WEIGHTS_POLL_S = 0.5
"""While the loop waits for a rollout: how often it asks whether the engines need the weights sent again."""

def run(cfg: SlimeConfig, run_dir: Path) -> str:
    """Train with RL as configured; returns "done" or "preempted" (a checkpoint was written on a signal).

    ``<run_dir>/run.json`` says how the run stands for ``python -m slime_hydra.status``: the driver's host and pid
    while it runs, then how it ended (outcome done | preempted | failed, with the error)."""
    run_dir = Path(run_dir)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "outcome": "running"}
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / RUN_RECORD, record)
    outcome, error = "failed", None
    try:
        if not os.environ.get("RAY_ADDRESS"):  # this run's own node: its thread counts follow the idle cores
            usable_cores()  # sampled (once per process) before the warm start and Ray's daemons load the cores
        model_path = resolve_model_path(cfg.model, cfg.data, cfg.seed)
        record["model_path"] = str(model_path)  # what export.py builds the run's HF exports on
        teacher = resolve_teacher(cfg, model_path)  # algo=opd's (built like the model, if an option is built)
        write_json(run_dir / RUN_RECORD, record)
        local_ray = init_ray(cfg, run_dir)
        try:
            preempt.install()  # after ray.init, which installs its own SIGTERM handler in the driver
            session = Session(cfg, derive(cfg), run_dir, model_path, teacher)
            try:
                outcome = session.train()
                return outcome
            finally:
                session.close()
        except ray.exceptions.RayActorError as exc:
            print(death_report(exc, local_ray, run_dir / "logs" / "ray"), flush=True)
            raise
        finally:
            if local_ray is not None:  # also when the session failed to start: its actors go with the node
                ray.shutdown()
                local_ray.stop(keep_logs_in=run_dir / "logs" / "ray")
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        write_json(run_dir / RUN_RECORD, {**record, "outcome": outcome, "error": error, "ended": time.time()})


def init_ray(cfg: SlimeConfig, run_dir: Path) -> Optional[LocalRay]:
    """Join the Ray cluster in RAY_ADDRESS (a SLURM job), or start this machine's node (cluster/local_ray.py: one
    logical CPU per role process on a CPU-only machine, at least its cores); returns it (to stop at the end) or None."""
    d = derive(cfg)
    cpus = cfg.cluster.cpus_per_node or max(os.cpu_count() or 1, d.total_gpus if cfg.cluster.gpus_per_node == 0 else 1)
    return connect(cpus, run_dir / "logs" / "ray_start.log")


class Session:
    """The live parts of one run and the loop over steps; ``rl_step`` is one step, top to bottom."""

    trainer: Optional["TrainGroup"]
    """The policy's rank actors (train/group.py); None in debug=rollout_only."""
    critic: Optional["TrainGroup"]
    """PPO's value model, on the same bundles (algo.needs_critic)."""
    manager: Optional[ray.actor.ActorHandle]
    """The RolloutManager actor (rollout/manager.py): engines, router, prompts, buffer, rewards, eval sets; None in
    debug=train_only."""
    turns: GpuTurns
    """Who holds the colocated GPUs' memory, and the moves between them (turns.py)."""
    tracker: Optional[Tracker]
    """metrics.jsonl, wandb, TensorBoard (tracking/tracker.py)."""
    timer: StepTimer
    """The step being timed, phase by phase (tracking/phases.py)."""
    doctor: Optional[StallDoctor]
    """Watches for a run that stopped moving (stall.py)."""
    checkpoints: Checkpoints
    """Where the run resumes from, a folder for each save, and its completion (checkpoint.py)."""

    def __init__(self, cfg: SlimeConfig, d: Derived, run_dir: Path, model_path: Path, teacher: Optional[Path] = None):
        self.cfg, self.d, self.run_dir, self.model_path, self.teacher_path = cfg, d, run_dir, model_path, teacher
        self.debug = cfg.debug.mode
        self.trainer = self.critic = self.manager = self.pg = self.tracker = None
        self.engine_urls: list[str] = []
        tokenizer = load_tokenizer(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.checkpoints = Checkpoints(run_dir, cfg.keep_checkpoints)
        self.resume_from = self.checkpoints.resume_from(cfg.resume)  # verified; what never will be is set aside
        self.placement()
        together = not (self.on_gpu and cfg.cluster.colocate)  # see start_rollout
        rollout = self.start_rollout() if self.debug != "train_only" and together else None
        if self.debug != "rollout_only":
            self.start_trainer()
        if self.debug != "train_only":
            self.engine_urls = ray.get(self.start_rollout() if rollout is None else rollout)
        if self.trainer is not None and self.manager is not None:
            self.trainer.connect_rollout(d.weight_sync, self.manager, cfg.train.weight_sync_bucket_mb, str(run_dir),
                                         d.engine_dtype, adapter=d.lora_sync == "adapter")
        self.step, self.rollouts_ahead = 0, deque()  # async: the next steps' rollouts, started (oldest first)
        self.timer, self.doctor = StepTimer(), None
        self.last_save = time.monotonic()  # save_every_minutes counts from the start, then from each save
        self.saving, self.write_time = None, None  # see finish_save
        self.turns = GpuTurns([g for g in (self.trainer, self.critic) if g is not None], self.manager,
                              self.colocated_moves and None not in (self.trainer, self.manager))
        if self.resume_from is not None:
            self.load(self.resume_from)
        # rows after the checkpoint's step (all of them without one) were logged by a run that died: logged again
        self.tracker = Tracker(cfg.tracking, run_dir, run_dir.name, asdict(cfg), resume_step=self.step or -1)

    # ---- set-up --------------------------------------------------------------------------------------------------
    def placement(self) -> None:
        """One bundle per GPU, or per role process on a CPU-only machine; wait until Ray reserved them all."""
        self.on_gpu = self.cfg.cluster.gpus_per_node > 0
        self.colocated_moves = bool(plan_memory(self.cfg, self.d).colocated_moves)
        self.pg = placement_group(placement_bundles(self.on_gpu, bundle_nodes(self.cfg, self.d)), strategy="PACK")
        ray.get(self.pg.ready(), timeout=self.cfg.cluster.ray_wait_nodes_s)

    @property
    def cpu_threads(self) -> int | None:
        """CPU-only, sync: trainer and engines take turns, each on every idle core (cores.py); else Ray's CPUs."""
        on_ray_cpus = self.on_gpu or self.cfg.mode == "async" or os.environ.get("RAY_ADDRESS")
        return None if on_ray_cpus else usable_cores()

    def start_trainer(self) -> None:
        from slime_hydra.train.group import TrainGroup

        cfg, d = self.cfg, self.d
        total = cfg.num_steps * d.optimizer_steps_per_rollout
        gpus = (0.5 if cfg.cluster.colocate else 1.0) if self.on_gpu else 0.0  # colocated: engines take half a bundle
        self.trainer = TrainGroup(self.pg, cfg.train.num_gpus, cfg.train.backend, self.model_path, cfg.train, total,
                                  cfg.algo.loss_agg, cfg.algo.needs_reference, gpus_per_rank=gpus, cpus_per_rank=1.0,
                                  torch_threads=self.cpu_threads, batch_invariant=cfg.algo.true_on_policy,
                                  deterministic=cfg.deterministic, teacher_path=self.teacher_path)
        if cfg.algo.needs_critic:
            self.critic = TrainGroup(self.pg, cfg.train.num_gpus, cfg.train.backend, self.model_path, cfg.train,
                                     total, cfg.algo.loss_agg, False, gpus_per_rank=gpus / 2 if gpus else 0.0,
                                     role="critic", cpus_per_rank=0.0, deterministic=cfg.deterministic)

    def start_rollout(self) -> ray.ObjectRef:
        """Create the engine actors and the rollout manager; returns the future of its start (the engine URLs).
        Called before the trainer starts, so the two sides start at once (processes, imports, the model, the engine
        servers: seconds each), except colocated on GPUs, where the engines start once the trainer holds its memory."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        from slime_hydra.rollout.engines.actor import EngineSpec, engine_gpu_ids
        from slime_hydra.rollout.manager import RolloutManager
        from slime_hydra.train.lora import adapter_config

        cfg, d = self.cfg, self.d
        first = 0 if cfg.cluster.colocate else d.train_gpus
        launcher = ENGINE_KINDS[cfg.rollout.backend].launcher  # None: the embedded engine's own command line
        sglang = (import_callable(launcher, "engine kind launcher", "fn(cfg, dtype, model_path, adapter)")(
            cfg, d.engine_dtype, str(self.model_path), d.lora_sync == "adapter") if launcher else None)
        tp = cfg.rollout.gpus_per_engine
        gpu_ids = engine_gpu_ids(self.pg, first, d.num_engines, tp) if self.on_gpu else [None] * d.num_engines
        lora = adapter_config(cfg.train.lora) if d.lora_sync == "adapter" else None
        spec = EngineSpec(dict(model_path=str(self.model_path), log_dir=str(self.run_dir / "logs"),
                               dtype=d.engine_dtype, torch_threads=self.cpu_threads, sglang=sglang, lora=lora,
                               max_batch_size=cfg.rollout.batch_prompts * cfg.rollout.n_samples_per_prompt,
                               return_routed_experts=cfg.algo.routing_replay, batch_invariant=d.batch_invariant_engines))
        gpus = (0.5 if cfg.cluster.colocate else 1.0) if self.on_gpu else 0.0
        engines = [spec.make(i, gpus, PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=first
                                                                       + i * tp), gpu_ids[i])
                   for i in range(d.num_engines)]
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)  # router too
        self.manager = ray.remote(RolloutManager).options(num_cpus=0, scheduling_strategy=here).remote(
            cfg, str(self.model_path), str(self.run_dir), engines, spec)
        return self.manager.start.remote()

    # ---- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> str:
        """The steps, watched by the stall doctor (stall.py) unless ``stall_after_minutes=0``."""
        if not self.cfg.stall_after_minutes:
            return self._steps()
        self.doctor = StallDoctor(self.run_dir, 60 * self.cfg.stall_after_minutes, self.cfg.on_stall,
                                  self.stall_probe, self.waits_on).start()
        try:
            return self._steps()
        except KeyboardInterrupt:
            if self.doctor.verdict:  # the doctor interrupted the main thread to stop the run
                raise StallError(self.doctor.verdict) from None
            raise
        finally:
            self.doctor.stop()

    def stall_probe(self) -> tuple[int, str]:
        if self.manager is None:
            return 0, "none (no rollout side in this debug mode)"
        return ray.get(self.manager.stall_probe.remote(), timeout=PROBE_TIMEOUT_S)

    def waits_on(self) -> str:
        """The driver's step, phase and whom that phase waits on, for the stall doctor."""
        phase = self.timer.current
        return f"step {self.step + 1}, phase {phase or '-'}: waiting for {WAITS_ON.get(phase, 'nobody')}"

    def _steps(self) -> str:
        cfg = self.cfg
        progress = ProgressView(cfg.num_steps, self.step, enabled=cfg.tracking.progress)
        with progress:
            if self.step == 0 and self._eval_due(0):
                timer = self.timer = StepTimer()
                metrics = self.evaluate(timer)
                metrics["perf/eval_time"] = timer.times["eval"]
                self.tracker.log(0, metrics)                                 # row 0: the eval before training
                progress.before_training(metrics)
            while self.step < cfg.num_steps:
                metrics = self.rl_step(self.step)                            # self.step: steps done, k after the k-th
                self.tracker.log(self.step, metrics)                         # track: row k is the k-th step's
                progress.update(self.step, metrics)
                if self.doctor is not None:
                    self.doctor.beat()
                if self.manager is not None:
                    engine_requests.serve(self.run_dir, self.manager)        # engines added or removed by command
                if preempt.requested() and self.step < cfg.num_steps:
                    return "preempted"
        if not self._save_due():
            self.save(wait=True)
        self.export()
        return "done"

    def rl_step(self, step: int) -> dict[str, float]:
        """One RL step, in the algorithm's order; returns its metrics. Colocated on GPUs, ``turns`` first hands the
        memory to whoever works next (a no-op otherwise)."""
        cfg, timer = self.cfg, StepTimer()
        self.timer = timer
        sft = cfg.algo.from_data  # sft, dpo: its batches are the data's: the engines work for the evals alone
        self.turns.hand_to("trainer" if sft else "engines", timer)
        samples, metrics = self.rollout_phase(step, timer)                  # rollout -> rewards -> filter
        if self.trainer is not None:
            self.turns.hand_to("trainer", timer)
            metrics.update(self.train_phase(samples, timer))                # logprobs -> advantages -> train
            sync = self._eval_due(step + 1) if sft else (step + 1) % cfg.sync_every_steps == 0
            if sync and self.manager is not None:
                self.turns.hand_to("both", timer)
                with timer.phase("weight_sync"):                            # sync: engines get version step + 1
                    metrics.update(self.trainer.push_weights(step + 1))
        self.step = step + 1
        if self._eval_due(self.step):                                       # eval
            self.turns.hand_to("engines", timer)
            metrics.update(self.evaluate(timer))
        due = self._save_due() or preempt.requested()
        if due or self.saving is not None:                                  # save (what the step waits for)
            with timer.phase("checkpoint"):
                self.finish_save()                                          # latest moves once the write is done
                if due:  # the run's last save waits for its write: nothing is left to overlap it with
                    self.save(wait=self.step == cfg.num_steps or preempt.requested())
        if self.write_time is not None:
            metrics["perf/checkpoint_write_time"], self.write_time = self.write_time, None
        metrics.update(self.turns.metrics())
        if self.on_gpu and self.trainer is not None:  # for the memory plan's calibration (config/memory.py)
            metrics["perf/trainer_gpu_peak_gb"] = max(self.trainer.call("peak_memory")) / 2**30
        metrics.update(timer.metrics(tokens=metrics.get("rollout/tokens")))
        return metrics

    def rollout_phase(self, step: int, timer: StepTimer) -> tuple[list[Sample], dict]:
        """This step's samples and rollout metrics (timed as ``rollout``); in async mode also starts the next
        rollout. While it waits, a rollout that cannot go on because every engine restarted and lost the weights
        (a broadcast or CUDA IPC sync cannot be replayed by the rollout side) gets them again (``resend_weights``)."""
        if self.debug == "train_only":
            with timer.phase("rollout"):
                return load_saved_rollout(Path(self.cfg.debug.rollout_path), step), {}
        future = self.rollouts_ahead.popleft() if self.rollouts_ahead else self.manager.generate_batch.remote(step)
        resends = 0
        while True:
            with timer.phase("rollout"):  # asking the manager whether it lost the weights is part of the wait
                if ray.wait([future], timeout=WEIGHTS_POLL_S)[0]:
                    break
                lost = self.trainer is not None and ray.get(self.manager.needs_weights.remote())
            if self.doctor is not None and self.doctor.interrupted:  # its interrupt was swallowed on the way
                raise KeyboardInterrupt
            if lost:
                self.resend_weights(step, timer)
                resends += 1
        with timer.phase("rollout"):
            result = ray.get(future)
        ahead = self.rollouts_ahead  # async: the next max_staleness steps' rollouts (one at least) are on their way
        while self.cfg.mode == "async" and len(ahead) < max(1, self.cfg.max_staleness) \
                and step + 1 + len(ahead) < self.cfg.num_steps:
            ahead.append(self.manager.generate_batch.remote(step + 1 + len(ahead)))  # the batch of that step
        if self.cfg.debug.save_rollouts:
            save_rollout(self.run_dir / "rollouts", step + 1, result["samples"])
        metrics = dict(result["metrics"], **{"rollout/weight_resends": float(resends)})
        samples = [Sample.from_dict(s) for s in result["samples"]]
        # the trainer's policy is version `step` (rollout steps trained); how far behind the oldest sample is
        metrics["rollout/weight_version_lag"] = float(step - min(s.weight_version for s in samples))
        return samples, metrics

    def resend_weights(self, step: int, timer: StepTimer) -> None:
        """Send the current policy (version ``step``) again: restarted engines are waiting for it."""
        print(f"loop: step {step + 1}: the engines restarted without the current weights; sending version {step} again",
              flush=True)
        self.turns.hand_to("both", timer)
        with timer.phase("weight_sync"):
            self.trainer.push_weights(step)
        self.turns.hand_to("engines", timer)

    def train_phase(self, samples: list[Sample], timer: StepTimer) -> dict:
        """Old/ref logprobs and values, advantages, then the optimizer steps of one rollout batch."""
        cfg, algo = self.cfg, self.cfg.algo
        with timer.phase("logprobs"):
            routing = (cfg.model.num_layers, cfg.model.moe_top_k) if cfg.algo.routing_replay else None
            batch = to_train_batch(samples, self.pad_id, cfg.reward.reward_key, routing)
            temperature = cfg.rollout.temperature
            old = (self.trainer.logprobs(batch, "current", temperature)[0]
                   if needs_old_logprobs(algo, self.d.optimizer_steps_per_rollout) else None)
            ref = self.trainer.logprobs(batch, "ref", temperature)[0] if algo.needs_reference else None
            values = self.critic.values(batch) if self.critic is not None else None
        with timer.phase("teacher" if algo.distills else "logprobs"):  # algo=opd: the teacher scores every token
            teacher = self.trainer.logprobs(batch, "teacher", temperature)[0] if algo.distills else None
        prepared = add_advantages(batch, algo, cfg.rollout.n_samples_per_prompt, old, ref, values,  # (sft: none)
                                  cfg.rollout.max_response_tokens, teacher)
        with timer.phase("train"):
            loss = actor_loss(algo, cfg.rollout.max_response_tokens)
            sums: dict[str, float] = {}
            size = self.d.global_batch_samples
            for k in range(self.d.optimizer_steps_per_rollout):
                mini = batch.select(list(range(k * size, min((k + 1) * size, batch.size))))
                step_metrics = self.trainer.train_step(mini, loss, temperature, with_entropy=True)
                if self.critic is not None:
                    critic_metrics = self.critic.train_step(mini, CriticLoss(algo, cfg.rollout.max_response_tokens))
                    step_metrics.update({f"critic_{k}" if k in ("grad_norm", "lr") else k: v
                                         for k, v in critic_metrics.items()})
                for name, value in step_metrics.items():  # means over the optimizer steps; *_max metrics: maxima
                    sums[name] = (max(sums.get(name, float(value)), float(value)) if name.endswith("_max") else
                                  sums.get(name, 0.0) + float(value) / self.d.optimizer_steps_per_rollout)
        return {**{f"train/{k}": v for k, v in sums.items()}, **prepared}

    def evaluate(self, timer: StepTimer) -> dict:
        """The engines' evals (the manager's); algo=sft adds each eval set's held-out loss, the trainer's."""
        with timer.phase("eval"):
            metrics = ray.get(self.manager.evaluate.remote()) if self.manager is not None else {}
        if self.cfg.algo.objective == "sft" and self.trainer is not None and self.manager is not None:
            self.turns.hand_to("trainer", timer)
            with timer.phase("eval"):
                metrics.update(held_out_losses(self.trainer, ray.get(self.manager.held_out.remote()), self.pad_id))
        return metrics

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.rollout.eval_every_steps
        if not every or not self.cfg.data.eval or self.manager is None:
            return False
        return step % every == 0 or step == self.cfg.num_steps

    def _save_due(self) -> bool:
        every, minutes = self.cfg.save_every_steps, self.cfg.save_every_minutes
        return (self.step == self.cfg.num_steps or (every > 0 and self.step % every == 0)
                or (minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes))

    # ---- checkpoint ----------------------------------------------------------------------------------------------
    def save(self, wait: bool = False) -> None:
        """Start checkpoints/step_<k> once the previous save finished: the trainer ranks copy their state to host
        memory and write it in the background (``checkpoint_in_background``; else before they return), rollout.json
        and loop.json of the same step are written now; ``latest`` moves in ``finish_save`` (now, with ``wait``)."""
        self.finish_save(wait=True)
        ckpt = self.checkpoints.begin(self.step)
        for role, group in (("actor", self.trainer), ("critic", self.critic)):
            if group is not None:
                (ckpt / role).mkdir(exist_ok=True)
                group.call("save", str(ckpt / role), self.cfg.checkpoint_in_background)
        ahead = []
        if self.manager is not None:
            ahead = ray.get(list(self.rollouts_ahead))  # async: finish the rollouts started ahead and keep them
            self.rollouts_ahead = deque(ray.put(batch) for batch in ahead)
            write_json(ckpt / "rollout.json", ray.get(self.manager.state_dict.remote()))
        write_json(ckpt / "loop.json", {"step": self.step, "rollouts_ahead": ahead})
        self.saving, self.last_save = ckpt, time.monotonic()
        if wait or not self.cfg.checkpoint_in_background:
            self.finish_save(wait=True)

    def finish_save(self, wait: bool = False) -> None:
        """Once every trainer rank's files of ``self.saving`` are on disk, complete it in a thread (checksums,
        manifest, ``latest``, prune: checkpoint.Checkpoints.complete); both polled (``wait``: block until done). The
        slowest rank's write time (s) is added to ``self.write_time``, the step's metric. A failure raises here."""
        if self.saving is None:
            return
        if self.cfg.checkpoint_in_background and not self.checkpoints.completing(self.saving):
            times = [t for g in (self.trainer, self.critic) if g is not None for t in g.call("save_finished", wait)]
            if None in times:
                return
            if times:
                self.write_time = (self.write_time or 0.0) + max(times)
        if self.checkpoints.complete(self.saving, wait):
            self.saving = None

    def export(self) -> None:
        """The final policy as an HF checkpoint in ``<run_dir>/export/step_<N>`` (``export_at_end``): merged weights,
        config and tokenizer, and with train.lora the PEFT adapter in ``adapter/``; export.py writes the same from
        any checkpoint."""
        if not self.cfg.export_at_end or self.trainer is None:
            return
        out = export_dir(self.run_dir, self.step)
        self.trainer.call("export_hf", str(out))
        if self.cfg.train.lora.enabled:
            self.trainer.call("export_adapter", str(out / "adapter"))
        copy_tokenizer(self.model_path, out)
        print(f"the trained model: {out}", flush=True)

    def load(self, ckpt: Path) -> None:
        meta = json.loads((ckpt / "loop.json").read_text())
        self.step = int(meta["step"])
        if self.trainer is not None:
            self.trainer.call("load", str(ckpt / "actor"))
        if self.critic is not None:
            self.critic.call("load", str(ckpt / "critic"))
        if self.manager is not None:
            ray.get(self.manager.load_state_dict.remote(json.loads((ckpt / "rollout.json").read_text())))
            ahead = meta.get("rollouts_ahead", [meta.get("next_rollout")])  # older checkpoints: one, or null
            self.rollouts_ahead = deque(ray.put(batch) for batch in ahead if batch is not None)
            if self.trainer is not None and self.step > 0:
                self.trainer.push_weights(self.step)  # the engines restart from the initial weights
        print(f"resumed from {ckpt} after step {self.step}", flush=True)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        if self.manager is not None:
            try:
                ray.get(self.manager.shutdown.remote(), timeout=60)
            except Exception as error:  # shutting down after a failure: report, keep tearing down
                print(f"rollout manager shutdown: {error}", flush=True)
        for group in (self.trainer, self.critic):
            if group is not None:
                group.shutdown()
        if self.pg is not None:
            remove_placement_group(self.pg)
