"""The SLURM pieces that need no SLURM: node accounting, the Ray environment, ports, status parsing."""

import json
import os
import pickle

import pytest

from slime_hydra import status
from slime_hydra.cluster.config import ClusterConfig
from slime_hydra.cluster.ray_cluster import (RayBootstrapError, head_port, missing_nodes, ray_process_env,
                                             temp_dir_for, token_env, write_token)
from slime_hydra.launch.submit import record_failure


def test_missing_nodes_names_the_hosts_that_did_not_join():
    expected = ["gpu01", "gpu02", "gpu03"]
    assert missing_nodes(expected, ["gpu01.cluster", "gpu03"]) == ["gpu02"]
    assert missing_nodes(expected, ["a", "b", "c"]) == []  # enough nodes, whatever their names
    assert missing_nodes(["vm", "vm"], ["vm"]) == ["vm"]


def test_ray_processes_lose_the_scheduler_rank_variables_and_present_the_job_token(tmp_path):
    token = write_token(tmp_path / "job")
    env = ray_process_env(tmp_path / "job", {"SLURM_PROCID": "1", "PMI_RANK": "1", "PMIX_RANK": "1",
                                             "SUBMITIT_FOLDER": "x", "RAY_ADDRESS": "old:1",
                                             "CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["PATH"] == "/bin"
    assert not {"SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "SUBMITIT_FOLDER", "RAY_ADDRESS"} & set(env)
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN_PATH"]) == ("token", str(token))
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    assert token.read_text() not in "".join(env.values())  # only the path travels


def test_a_missing_or_shared_token_stops_the_job_before_ray_starts(tmp_path):
    with pytest.raises(RayBootstrapError, match="ray_auth_token is missing"):
        token_env(tmp_path)
    write_token(tmp_path).chmod(0o644)
    with pytest.raises(RayBootstrapError, match=r"mode 644: others could join.*chmod 600"):
        token_env(tmp_path)


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
    assert status.main([str(tmp_path / "runs")]) == 1  # before the first run: no output_dir yet
    assert "no runs yet: " in capsys.readouterr().err


def test_a_failed_runs_reason_is_one_line_without_colour_codes(tmp_path):
    """A Ray actor's error, as loop.run records it: the exception type, the actor's coloured traceback."""
    error = ("RayTaskError(ValueError): \x1b[36mray::TrainRank.train_step()\x1b[39m (pid=7, ip=127.0.0.1)\n"
             "  File \"/x/backend.py\", line 3, in train_step\n    raise ValueError('nan loss')\n"
             "ValueError: nan loss\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text(json.dumps({"outcome": "failed", "error": error}))
    assert status.local_state(tmp_path / "r") == ("FAILED", "ValueError: nan loss (the whole error: run.json)")
    assert status.error_summary("\x1b[31mRuntimeError: boom\x1b[0m") == "RuntimeError: boom"
    assert status.error_summary("") == ""


class RunsCode:
    """Unpickling this creates a directory: what any code in a result pickle could do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def failed(error: BaseException) -> BaseException:
    try:
        raise error
    except type(error) as raised:
        return raised


def test_a_failed_job_shows_its_error_without_unpickling_anything(tmp_path, monkeypatch):
    """A FAILED job (sacct answers from a stand-in: no SLURM here) shows the error its task recorded as JSON, else
    the last line of rank 0's stderr log, else SLURM's exit code; the result pickle beside them, which would run
    code if loaded, is never loaded (pickle refuses during the calls)."""
    run, folder, bin_dir = tmp_path / "run", tmp_path / "run" / "slurm" / "20240101", tmp_path / "bin"
    folder.mkdir(parents=True)
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho '7|FAILED|1:0|None'\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    stderr = folder / "7_0_log.err"
    (run / "job.json").write_text(json.dumps({"job_id": "7", "submitit_folder": str(folder),
                                              "stdout": str(folder / "7_0_log.out"), "stderr": str(stderr)}))
    (folder / "7_0_result.pkl").write_bytes(pickle.dumps(("error", RunsCode(tmp_path / "unpickled"))))
    # the job's side: each task writes its record where submitit's JobEnvironment says
    for rank in (2, 0):
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
        monkeypatch.setenv("SUBMITIT_FOLDER", str(folder))
        monkeypatch.setenv("SLURM_JOB_ID", "7")
        monkeypatch.setenv("SLURM_PROCID", str(rank))
        record_failure(failed(RuntimeError(f"rank {rank} broke\nsecond line")))

    def refuse(*args, **kwargs):
        raise AssertionError("status unpickled a file")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)

    def reason() -> str:
        (job,) = status.collect(run)
        assert job.state == "FAILED"
        return job.reason

    assert reason() == "RuntimeError: rank 0 broke"
    (folder / "7_0_error.json").unlink()
    assert reason() == "rank 2: RuntimeError: rank 2 broke"
    (folder / "7_2_error.json").write_text('{"rank": 2, "err')  # cut short: the log is read instead
    stderr.write_text("Traceback (most recent call last):\n  ...\nMemoryError: out of host memory\n\n"
                      "srun: error: node1: task 0: Exited with exit code 1\n")
    assert reason() == "MemoryError: out of host memory"
    stderr.unlink()
    assert reason() == "exit code 1:0"
    assert not (tmp_path / "unpickled").exists()


def test_the_error_record_is_json_with_the_traceback(tmp_path, monkeypatch):
    for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": str(tmp_path), "SLURM_JOB_ID": "9_3",
                       "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "3", "SLURM_PROCID": "1"}.items():
        monkeypatch.setenv(key, value)
    path = record_failure(failed(ValueError("bad")))
    record = json.loads(path.read_text())
    assert path == tmp_path / "9_3_1_error.json"
    assert (record["job_id"], record["rank"], record["error"]) == ("9_3", 1, "ValueError: bad")
    assert record["traceback"].startswith("Traceback (most recent call last):")
    assert record["traceback"].endswith("ValueError: bad\n")
