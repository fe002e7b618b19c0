"""Ray over a SLURM allocation: one Ray node per task, the head on rank 0, torn down when the job ends.

    with RayCluster(cfg.cluster) as ray_cluster:      inside a submitit job, on every task
        if ray_cluster.is_head:
            os.environ["RAY_ADDRESS"] = ray_cluster.address   # the job body runs as the Ray driver
            body(...)
        else:
            ray_cluster.serve()                       # blocks until the head goes away

- rank 0 runs ``ray start --head --block`` as a child process: GCS port ``cluster.ray_port + job_id % 1000``
  (two jobs sharing a node do not collide), temp dir ``/tmp/ray_<job_id>`` (``/tmp/ray_<job_id>_<rank>`` on other
  ranks; short: Ray's socket paths must stay under ~107 characters), explicit ``--num-cpus``/``--num-gpus``,
  node address = the SLURM host name's address, no dashboard;
- every other rank waits for the head's port, then runs ``ray start --address <head>:<port> --block``;
- the head waits for all ``num_tasks`` nodes, at most ``cluster.ray_wait_nodes_s``, and otherwise fails naming
  the hosts that did not join;
- the Ray processes get the job's environment minus the SLURM/PMI/PMIx/Open MPI/submitit variables: libraries
  in Ray workers (torch.distributed launchers, MPI-aware NCCL plugins, Lightning, submitit) read SLURM_PROCID,
  SLURM_NTASKS or PMI_RANK and believe they are one rank of the srun step. CUDA_VISIBLE_DEVICES stays: it is
  SLURM's GPU binding;
- teardown kills each ``ray start`` process group (SIGTERM, then SIGKILL after a grace period). If the job
  process itself is SIGKILLed, ``ray start`` gets SIGKILL too (PR_SET_PDEATHSIG) and Ray's reaper takes its
  process group down: nothing outlives the job, whatever SLURM's proctrack plugin. (``scancel`` is such a case:
  srun SIGKILLs the step at once, so only the node-local temp dir, files, may remain.) ``ray stop`` is never used:
  it would stop every Ray on the node, other jobs' included.
"""

import collections
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from slime_hydra.checkpoint import JOB_ERROR
from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.cluster.local_ray import NO_DRAIN_ENV, NORMAL_PRIORITY_ENV
from slime_hydra.lifetime import die_with_parent
from slime_hydra.net import answers, free_port

CLEARED_ENV_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "SUBMITIT_")
"""Variables removed from the environment of the Ray processes (and so of every actor)."""

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
           **NO_DRAIN_ENV, **NORMAL_PRIORITY_ENV}
"""Set for the Ray processes and the driver, with RAY_AUTH_TOKEN_PATH (``token_env``). Cluster mode must be ON here:
with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (right for single-machine runs, docs/architecture.md "Machine facts") ``ray
start --address`` refuses to join and a driver takes 127.0.0.1 as its node address; the explicit
``--node-ip-address`` keeps Ray off the machine's other interfaces instead. Token auth: every process that talks to
the GCS or a raylet (nodes, driver, workers, which inherit it) presents the job's token, so a host that reaches the
ports but cannot read the token file cannot join, submit work or read the run's secrets. No drain on stop
(local_ray.NO_DRAIN_ENV); workers at normal priority (local_ray.NORMAL_PRIORITY_ENV)."""

AUTH_TOKEN_FILE = "ray_auth_token"
"""The job's Ray token, in its submitit folder (shared storage, mode 0600): written at submission (``write_token``),
read by every task; requeued jobs keep the folder and so the token. Only its path travels (environment, logs)."""

NODE_IPS_ENV = "SLIME_HYDRA_NODE_IPS"
"""Set for the job body on the head: the allocation's node addresses, comma-separated, head first (SLURM's node
order). The run pins placement bundle b to node ``bundle_nodes(cfg, derived)[b]`` of this list (loop.py)."""

STOP_GRACE_S = 2.0
"""Seconds a ray start process group gets between SIGTERM and SIGKILL (the driver is done by then: nothing to
drain; SLURM's KillWait must stay longer)."""


class RayBootstrapError(RuntimeError):
    """Ray could not be brought up across the allocation (a node did not join, the head died)."""


def write_token(folder: Path) -> Path:
    """Create the job's Ray token in its submitit folder: 32 random bytes as hex, mode 0600 from the start."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / AUTH_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def token_env(folder: Path) -> dict:
    """RAY_ENV plus the path of the job's token; fails (RayBootstrapError) when the token is missing or readable
    by others."""
    path = Path(folder) / AUTH_TOKEN_FILE
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        raise RayBootstrapError(f"the job's Ray token {path} is missing (launch.py writes it at submission); "
                                "submit the job again") from None
    if mode & 0o077:
        raise RayBootstrapError(f"the job's Ray token {path} has mode {mode:o}: others could join its Ray cluster; "
                                f"chmod 600 {path}")
    return {**RAY_ENV, "RAY_AUTH_TOKEN_PATH": str(path)}


def ray_process_env(folder: Path, environ: Optional[dict] = None) -> dict:
    """The environment for ``ray start``: the job's, minus the scheduler's rank variables, plus ``token_env``."""
    environ = dict(os.environ if environ is None else environ)
    env = {k: v for k, v in environ.items() if not k.startswith(CLEARED_ENV_PREFIXES) and k != "RAY_ADDRESS"}
    env.update(token_env(folder))
    return env


def placement_bundles(on_gpu: bool, bundle_nodes: Sequence[int]) -> list[dict]:
    """One placement bundle per entry of ``bundle_nodes`` (config/derive.py): {GPU: 1, CPU: 1} per GPU, {CPU: 1}
    per role process on a CPU-only cluster; on a job of several nodes (NODE_IPS_ENV set) also a sliver of Ray's
    per-node resource ``node:<ip>``, which pins bundle b to node ``bundle_nodes[b]``: the layout the dry run shows
    is the one that runs."""
    unit = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}
    ips = [ip for ip in os.environ.get(NODE_IPS_ENV, "").split(",") if ip]
    if max(bundle_nodes, default=0) == 0:
        return [dict(unit) for _ in bundle_nodes]
    if max(bundle_nodes) >= len(ips):
        raise RayBootstrapError(f"the layout needs {max(bundle_nodes) + 1} nodes, the job has {len(ips)} "
                                f"({NODE_IPS_ENV}={os.environ.get(NODE_IPS_ENV, '')!r})")
    return [{**unit, f"node:{ips[node]}": 0.001} for node in bundle_nodes]


def head_port(cluster: ClusterConfig, job_id: str) -> int:
    """The head's GCS port: cluster.ray_port + job_id % 1000 (array task ids use their main job id)."""
    return cluster.ray_port + int(str(job_id).split("_")[0]) % 1000


def temp_dir_for(job_id: str, rank: int) -> str:
    """Ray's temp dir of one task, node-local and short (Unix socket paths are limited to ~107 characters);
    one per rank, so tasks sharing a host never remove each other's."""
    return f"/tmp/ray_{job_id}" if rank == 0 else f"/tmp/ray_{job_id}_{rank}"


def missing_nodes(expected_hosts: Sequence[str], joined_hosts: Sequence[str]) -> list[str]:
    """The expected hosts (one entry per task) with no Ray node yet; [] once enough nodes joined."""
    if len(joined_hosts) >= len(expected_hosts):
        return []
    short = lambda h: h.split(".")[0]  # noqa: E731 - SLURM node names vs gethostname() may differ by the domain
    missing = collections.Counter(map(short, expected_hosts)) - collections.Counter(map(short, joined_hosts))
    return sorted(missing.elements()) or [f"{len(expected_hosts) - len(joined_hosts)} unnamed node(s)"]


def node_gone(node: dict) -> bool:
    """A node of ``ray.nodes()`` that left: Ray marked it dead, or its raylet no longer accepts connections (Ray marks
    a lost node dead only after several missed health checks; a refused or unanswered connection says so at once)."""
    return not node["Alive"] or not answers(node["NodeManagerAddress"], node["NodeManagerPort"])


class RayCluster:
    """One Ray node per task of the current submitit job (see the module docstring)."""

    def __init__(self, cluster: ClusterConfig, job_env=None):
        import submitit

        self.cluster = cluster
        self.env = job_env if job_env is not None else submitit.JobEnvironment()
        self.job_id = str(self.env.job_id)
        self.rank = self.env.global_rank
        self.is_head = self.rank == 0
        self.head_host = self.env.hostnames[0]
        self.head_ip = socket.gethostbyname(self.head_host)
        self.port = head_port(cluster, self.job_id)
        self.address = f"{self.head_ip}:{self.port}"
        self.temp_dir = temp_dir_for(self.job_id, self.rank)
        self.folder = Path(self.env.paths.folder)
        # the driver (rank 0's job body) talks to Ray too; Ray reads these when it is first imported, so here,
        # before the job body's module is
        os.environ.update(token_env(self.folder))
        self.proc: Optional[subprocess.Popen] = None
        self.failed = False

    # ---- resources -------------------------------------------------------------------------------------------
    def num_cpus(self) -> int:
        """cluster.cpus_per_node, else the CPUs SLURM gave this task, else the machine's."""
        if self.cluster.cpus_per_node:
            return self.cluster.cpus_per_node
        for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        return os.cpu_count() or 1

    def expected_hosts(self) -> list[str]:
        """One host name per task (block distribution: ranks fill a node before the next)."""
        per_node = max(self.env.num_tasks // max(self.env.num_nodes, 1), 1)
        return [host for host in self.env.hostnames for _ in range(per_node)][: self.env.num_tasks]

    # ---- start / wait / serve / stop -------------------------------------------------------------------------
    def start(self) -> None:
        """Start this task's Ray node: the head on rank 0; elsewhere join once the head's port answers."""
        node_ip = socket.gethostbyname(socket.gethostname()) if not self.is_head else self.head_ip
        args = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={node_ip}", f"--temp-dir={self.temp_dir}", f"--num-cpus={self.num_cpus()}",
                f"--num-gpus={self.cluster.gpus_per_node}",
                f"--dashboard-agent-listen-port={free_port('')}"]  # the fixed default clashes between nodes of one host
        if self.is_head:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false"]
        else:
            self._wait_for_head()
            args += [f"--address={self.address}"]
        print(f"rank {self.rank}: {' '.join(args[3:])}", flush=True)
        self.proc = subprocess.Popen(args, env=ray_process_env(self.folder), start_new_session=True,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def _wait_for_head(self) -> None:
        deadline = time.monotonic() + self.cluster.ray_wait_nodes_s
        while not answers(self.head_ip, self.port):
            if time.monotonic() > deadline:
                raise RayBootstrapError(f"rank {self.rank}: the Ray head {self.address} ({self.head_host}) did not "
                                        f"answer within cluster.ray_wait_nodes_s={self.cluster.ray_wait_nodes_s} s")
            time.sleep(0.5)

    def wait_for_nodes(self) -> None:
        """Head only: block until every task's node joined; fail naming the missing hosts after the timeout."""
        import ray

        expected = self.expected_hosts()
        deadline = time.monotonic() + self.cluster.ray_wait_nodes_s
        while not answers(self.head_ip, self.port):
            self._check_alive()
            if time.monotonic() > deadline:
                raise RayBootstrapError(f"the Ray head did not open {self.address} within "
                                        f"cluster.ray_wait_nodes_s={self.cluster.ray_wait_nodes_s} s")
            time.sleep(0.25)
        ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
        try:
            while True:
                alive = [n for n in ray.nodes() if n["Alive"]]
                missing = missing_nodes(expected, [n["NodeManagerHostname"] for n in alive])
                if not missing:
                    cpus = sum(n["Resources"].get("CPU", 0) for n in alive)
                    gpus = sum(n["Resources"].get("GPU", 0) for n in alive)
                    print(f"Ray up at {self.address}: {len(alive)} node(s), {cpus:g} CPUs, {gpus:g} GPUs", flush=True)
                    os.environ[NODE_IPS_ENV] = ",".join(socket.gethostbyname(h) for h in self.env.hostnames)
                    return
                self._check_alive()
                self._check_other_ranks()
                if time.monotonic() > deadline:
                    raise RayBootstrapError(
                        f"{len(alive)} of {len(expected)} Ray nodes joined {self.address} within "
                        f"cluster.ray_wait_nodes_s={self.cluster.ray_wait_nodes_s} s; missing: {', '.join(missing)}. "
                        f"Their task logs (submitit folder, <job_id>_<rank>_log.err) say why.")
                time.sleep(0.5)
        finally:
            ray.shutdown()

    def lost_nodes(self) -> set[str]:
        """Head only, after the job body failed: the addresses of the job's nodes that are gone (``node_gone``).
        Empty when the head itself is unreachable."""
        import ray

        try:
            if not answers(self.head_ip, self.port):
                return set()
            if not ray.is_initialized():
                ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
            return {n["NodeManagerAddress"] for n in ray.nodes() if node_gone(n)}
        except Exception as error:  # the body's own error is the one to report
            print(f"could not ask Ray which nodes are gone: {error}", flush=True)
            return set()

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RayBootstrapError(f"rank {self.rank}: 'ray start' exited with code {self.proc.returncode}; "
                                    f"Ray's logs are in {self.temp_dir}/session_latest/logs")

    def _check_other_ranks(self) -> None:
        """Fail now, naming the host and its error, when another task already recorded that it failed (its error
        record in the submitit folder, launch/submit.py record_failure): its node will never join."""
        for rank in range(1, self.env.num_tasks):
            path = self.folder / JOB_ERROR.format(job_id=self.job_id, rank=rank)
            if path.exists():
                try:
                    record = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue  # being written: read on the next poll
                raise RayBootstrapError(f"rank {rank} on {record.get('host', '?')} failed before its Ray node "
                                        f"joined: {record.get('error', '?')}")

    def serve(self, poll_s: float = 1.0, misses: int = 3) -> None:
        """Non-head ranks: keep this node up until the head's GCS stops answering (or this node dies)."""
        missed = 0
        while missed < misses:
            if self.proc is not None and self.proc.poll() is not None:
                print(f"rank {self.rank}: ray start exited ({self.proc.returncode})", flush=True)
                return
            missed = 0 if answers(self.head_ip, self.port) else missed + 1
            time.sleep(poll_s)
        print(f"rank {self.rank}: the Ray head is gone; stopping this node", flush=True)

    def stop(self) -> None:
        """Disconnect this process from Ray, kill this task's ray start process group (SIGTERM, then SIGKILL); remove
        the temp dir unless failed. A process still connected when its node's raylet dies is ended by Ray on the
        spot (exit code 1), before it could record why the job failed: hence the disconnect first."""
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        if self.proc is not None:
            try:
                pgid = os.getpgid(self.proc.pid)
            except ProcessLookupError:
                pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    continue
                if sig == signal.SIGTERM:  # the leader left; SIGKILL whatever of its group remains
                    try:
                        time.sleep(0.5)
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                break
            self.proc = None
        if not self.failed:  # a failed bootstrap keeps Ray's logs (session_latest/logs) for the post-mortem
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayCluster":
        try:
            self.start()
            if self.is_head:
                self.wait_for_nodes()
        except BaseException:
            self.failed = True
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.failed = self.failed or exc_type is not None
        self.stop()
