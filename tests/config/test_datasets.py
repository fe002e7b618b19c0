"""Dataset files are read before anything starts: every malformed row at once (file:line), prompts that are too long
counted, a bounded scan saying what it covered."""

import json

import pytest

from slime_hydra.config import datasets
from slime_hydra.config.datasets import check_datasets
from tests.config.helpers import load


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def dataset(tmp_path):
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(50)]
    rows[3] = '{"prompt": "cut'                      # invalid JSON
    rows[10] = {"question": "1+1=", "label": "2"}    # missing key
    rows[20] = ""                                    # blank line
    rows[30] = {"prompt": 7, "label": "7"}           # wrong type
    rows[40] = {"prompt": "x" * 300, "label": "x"}   # too long for max_prompt_tokens=64
    return write(tmp_path / "train.jsonl", rows)


def test_every_malformed_row_is_named_at_once(dataset):
    cfg, _ = load("data=jsonl", f"data.path={dataset}", "data.max_prompt_tokens=64")
    (problem,) = list(check_datasets(cfg))
    assert problem.keys == ("data.path", "data.on_bad_line") and "4 malformed row(s) in all 50 rows" in problem.message
    for line, what in ((4, "invalid JSON"), (11, "missing prompt key"), (21, "blank line"), (31, "'prompt' holds a int")):
        assert f"{dataset}, line {line}: {what}" in problem.message
    assert "data.on_bad_line=skip" in problem.fix


def test_skip_notes_what_the_run_will_skip_and_drop(dataset):
    cfg, _ = load("data=jsonl", f"data.path={dataset}", "data.max_prompt_tokens=64", "data.on_bad_line=skip")
    notes = []
    assert list(check_datasets(cfg, notes)) == []
    assert "4 malformed row(s) in all 50 rows will be skipped" in notes[0]
    assert "1 prompt(s) longer than data.max_prompt_tokens=64 will be dropped" in notes[1]


def test_no_prompt_left_is_a_problem(tmp_path):
    path = write(tmp_path / "long.jsonl", [{"prompt": "y" * 100, "label": "y"}] * 3)
    cfg, _ = load("data=jsonl", f"data.path={path}", "data.max_prompt_tokens=64")
    (problem,) = list(check_datasets(cfg))
    assert problem.keys == ("data.path", "data.max_prompt_tokens") and "none would be left" in problem.message


def test_a_bounded_scan_says_what_it_covered(dataset, monkeypatch):
    monkeypatch.setattr(datasets, "MAX_ROWS", 10)
    cfg, _ = load("data=jsonl", f"data.path={dataset}", "data.max_prompt_tokens=64")
    (problem,) = list(check_datasets(cfg))
    assert "1 malformed row(s) in the first 10 rows (a bounded scan" in problem.message


def test_dry_run_refuses_a_broken_dataset(dataset):
    from tests.config.test_launch import launch

    out = launch("data=jsonl", f"data.path={dataset}", "data.max_prompt_tokens=64", "dry_run=true")
    assert out.returncode == 2 and f"{dataset}, line 21: blank line" in out.stderr


def test_sft_refuses_rows_without_a_response_before_anything_starts(tmp_path):
    """algo=sft trains on data.response_key (and scores its held-out loss on the eval rows'): a row without it is
    malformed there (and only there: the same file is a good prompt file for RL)."""
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1), "response": str(i + 1)} for i in range(20)]
    rows[7] = {"prompt": "7+1=", "label": "8"}
    path = write(tmp_path / "sft.jsonl", rows)
    cfg, _ = load("recipes=tiny_sft_cpu", "data=jsonl", f"data.path={path}", "data.max_prompt_tokens=64")
    (problem,) = list(check_datasets(cfg))
    assert problem.keys == ("data.path", "data.on_bad_line") and "1 malformed row(s) in all 20 rows" in problem.message
    assert f"{path}, line 8: missing response key 'response'" in problem.message
    cfg, _ = load("data=jsonl", f"data.path={path}", "data.max_prompt_tokens=64")
    assert list(check_datasets(cfg)) == []
