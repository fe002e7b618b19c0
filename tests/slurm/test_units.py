"""The SLURM pieces that need no SLURM: node accounting, the Ray environment, ports, status parsing."""

import json

from slime_hydra import status
from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.cluster.ray_cluster import head_port, missing_nodes, ray_process_env, temp_dir_for


def test_missing_nodes_names_the_hosts_that_did_not_join():
    expected = ["gpu01", "gpu02", "gpu03"]
    assert missing_nodes(expected, ["gpu01.cluster", "gpu03"]) == ["gpu02"]
    assert missing_nodes(expected, ["a", "b", "c"]) == []  # enough nodes, whatever their names
    assert missing_nodes(["vm", "vm"], ["vm"]) == ["vm"]


def test_ray_processes_lose_the_scheduler_rank_variables():
    env = ray_process_env({"SLURM_PROCID": "1", "PMI_RANK": "1", "PMIX_RANK": "1", "SUBMITIT_FOLDER": "x",
                           "RAY_ADDRESS": "old:1", "CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["PATH"] == "/bin"
    assert not {"SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "SUBMITIT_FOLDER", "RAY_ADDRESS"} & set(env)
    assert env["RAY_AUTH_MODE"] == "disabled"


def test_ports_and_temp_dirs_follow_the_job_id():
    assert head_port(ClusterConfig(ray_port=6379), "123456") == 6379 + 456
    assert head_port(ClusterConfig(ray_port=6379), "123_4") == 6379 + 123
    assert temp_dir_for("123", 0) == "/tmp/ray_123" and len(temp_dir_for("9" * 12, 999)) < 40


def test_status_reads_metrics_and_survives_missing_slurm(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sacct/squeue/scontrol at all: UNKNOWN, no hang, no crash
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "7", "stdout": "o", "stderr": "e"}))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "rollout/raw_reward": 0.1}\nnot json\n{"step": 1}\n')
    (run,) = status.collect(tmp_path)
    assert (run.state, run.last_step, run.last_reward, run.logs) == ("UNKNOWN", 1, 0.1, ["o", "e"])


def test_status_reads_local_runs(tmp_path, capsys):
    import json
    import os
    import socket

    host = socket.gethostname()
    records = {"live": {"host": host, "pid": os.getpid(), "outcome": "running"},
               "killed": {"host": host, "pid": 2 ** 22 + 12345, "outcome": "running"},
               "finished": {"host": host, "pid": 1, "outcome": "done"},
               "stopped": {"host": host, "pid": 1, "outcome": "preempted"},
               "broken": {"host": host, "pid": 1, "outcome": "failed", "error": "RuntimeError: boom"}}
    for name, record in records.items():
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "run.json").write_text(json.dumps(record))
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 3, "rollout/raw_reward": 0.5}) + "\n")
    (tmp_path / "stopped" / "checkpoints" / "latest").write_text("step_000004\n")
    got = {s.run_dir.name: s for s in status.collect(tmp_path)}
    assert {n: got[n].state for n in records} == {"live": "RUNNING", "killed": "DIED", "finished": "DONE",
                                                  "stopped": "PREEMPTED", "broken": "FAILED"}
    assert got["broken"].reason == "RuntimeError: boom" and "resume" in got["killed"].reason
    assert got["stopped"].checkpoint == "step_000004" and got["live"].last_step == 3
    assert status.main([str(tmp_path)]) == 0 and "step_000004" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert status.main([str(tmp_path / "empty")]) == 1 and "no runs" in capsys.readouterr().err
