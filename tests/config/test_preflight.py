"""Pre-flight reads what the run will read (issue 45): data rows streamed with a byte cap, the custom reward called
once on a real row, plug-ins imported whatever they raise, config.json parsed, output_dir written, every number
finite, cross-field ranges held. Each mistake is refused with the key that fixes it, before anything starts."""

import json
import subprocess
import sys
import textwrap

import pytest

from slime_hydra.config import PROJECT_ROOT, compose, to_config
from slime_hydra.config.preflight import preflight as run_preflight
from slime_hydra.data.dataset import load_prompt_file
from slime_hydra.model.tiny import build_tiny_tokenizer
from tests.config.helpers import problems

JSONL = ("data=jsonl", "data.max_prompt_tokens=64")
"""A prompt file with the tiny model (context 256)."""


def preflight(*overrides: str) -> list:
    """Every problem launch() finds before anything starts, in its order (config/preflight.py), for a real run."""
    return run_preflight(to_config(compose(overrides))).refused(dry_run=False)


def only(found: list, key: str, fragment: str) -> str:
    """The one problem found, which names ``key`` and says ``fragment``; its text (asserted: never empty)."""
    assert len(found) == 1, [str(p) for p in found]
    text = str(found[0])
    assert key in found[0].keys and fragment in text, text
    return text


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A module `plug` of user functions on sys.path; returns a function writing its source."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        (tmp_path / "plug.py").write_text(textwrap.dedent(source))
        sys.modules.pop("plug", None)
        return "plug"
    yield write
    sys.modules.pop("plug", None)


def rows(path, *lines: str | bytes) -> str:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return str(path)


GOOD = json.dumps({"prompt": "1+1=", "label": "2"})


# ---- data -----------------------------------------------------------------------------------------------------------
def test_an_empty_file_and_a_slice_past_the_end_are_refused(tmp_path):
    empty = rows(tmp_path / "empty.jsonl")
    assert only(preflight(*JSONL, f"data.path={empty}"), "data.path", "has no rows: the run would have no prompts")
    two = rows(tmp_path / "two.jsonl", GOOD, GOOD)
    text = only(preflight(*JSONL, f"data.path={two}", "data.row_start=5"), "data.row_start", "no rows in [5, end)")
    assert "widen data.row_start / data.row_end" in text


def test_a_file_whose_every_row_is_skipped_is_refused(tmp_path):
    bad = rows(tmp_path / "bad.jsonl", "not json", '{"prompt": 3}')
    assert only(preflight(*JSONL, f"data.path={bad}", "data.on_bad_line=skip"), "data.on_bad_line",
         "every one of the 2 rows")


def test_a_huge_line_is_a_bad_row_read_in_bounded_memory(tmp_path):
    """A 3 MiB line over a 1 MiB cap: the scan names line 2, and the run's loader skips it (on_bad_line=skip)
    while the lines after it still load; the line is never held whole."""
    path = rows(tmp_path / "big.jsonl", GOOD, json.dumps({"prompt": "x" * (3 << 20), "label": "1"}), GOOD)
    text = only(preflight(*JSONL, f"data.path={path}"), "data.on_bad_line", "line 2: longer than")
    assert "data.max_row_bytes=1,048,576" in text
    dataset = load_prompt_file(path, build_tiny_tokenizer(), on_bad_line="skip", max_row_bytes=1 << 20)
    assert [r.row for r in dataset.records] == [0, 2] and dataset.stats.skipped == {"too_large": 1}


def test_the_byte_cap_holds_exactly_at_its_bound(tmp_path):
    line = json.dumps({"prompt": "ab", "label": "1"})
    path = rows(tmp_path / "edge.jsonl", line, line + " ")
    tokenizer = build_tiny_tokenizer()
    kept = load_prompt_file(path, tokenizer, on_bad_line="skip", max_row_bytes=len(line))
    assert [r.row for r in kept.records] == [0] and kept.stats.skipped == {"too_large": 1}
    assert len(load_prompt_file(path, tokenizer, max_row_bytes=len(line) + 1).records) == 2


def test_a_row_that_is_not_utf8_names_its_line(tmp_path):
    path = rows(tmp_path / "latin1.jsonl", GOOD, b'{"prompt": "caf\xe9", "label": "1"}')
    assert only(preflight(*JSONL, f"data.path={path}"), "data.on_bad_line", "line 2: not UTF-8 (byte 16")


# ---- the reward, called once ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, key, fragment", [
    ("return {'score': 1.0}", "reward.reward_key", "returned a dict with keys ['score'], and reward.reward_key=None"),
    ("return 1 / 0", "reward.target", "raised ZeroDivisionError: division by zero at"),
    ("return float('nan')", "reward.target", "returned nan"),
    ("return 'yes'", "reward.target", "returned 'yes'"),
    ("return None", "reward.target", "returned None"),
])
def test_a_custom_reward_is_called_once_on_the_first_row(plugins, body, key, fragment):
    plugins(f"def score(response, label, metadata):\n    {body}\n")
    assert only(preflight("reward=custom", "reward.target=plug.score"), key, fragment)


def test_a_good_reward_passes_and_sees_the_row(plugins, tmp_path):
    """The row's label and metadata reach the call: the reward asserts them."""
    path = rows(tmp_path / "meta.jsonl", json.dumps({"prompt": "q", "label": "42", "meta": {"source": "t"}}))
    plugins("""
        async def score(response, label, metadata):
            assert (response, label, metadata) == ("42", "42", {"source": "t"}), (response, label, metadata)
            return {"score": 1.0}
    """)
    assert preflight(*JSONL, f"data.path={path}", "data.metadata_key=meta", "reward=custom",
                     "reward.target=plug.score", "reward.reward_key=score") == []


def test_a_group_reward_that_returns_too_few_is_refused(plugins):
    plugins("""
        from slime_hydra.reward.registry import group_reward

        @group_reward
        def score(responses, labels, metadatas):
            return [1.0]
    """)
    assert only(preflight("reward=custom", "reward.target=plug.score"), "reward.target", "returned 1 rewards for 8")


# ---- plug-ins -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("top, fragment", [
    ("raise RuntimeError('no GPU here')", "RuntimeError: no GPU here, at "),
    ("import sys; sys.exit(3)", "SystemExit: 3, at "),
    ("1 +", "SyntaxError"),
])
def test_a_plugin_whose_import_raises_anything_is_refused(plugins, top, fragment):
    plugins(f"{top}\ndef score(response, label, metadata):\n    return 1.0\n")
    text = only(preflight("reward=custom", "reward.target=plug.score"), "reward.target", "cannot be imported")
    assert fragment in text


# ---- files ----------------------------------------------------------------------------------------------------------
def test_a_broken_config_json_is_refused_by_key(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    found = [p for p in preflight(f"model.path={tmp_path}") if "model.path" in p.keys]
    assert only(found, "model.path", "config.json cannot be read: JSONDecodeError")
    (tmp_path / "config.json").write_text("[1, 2]")
    found = [p for p in preflight(f"model.path={tmp_path}") if "model.path" in p.keys]
    assert only(found, "model.path", "a JSON object")


def test_a_checkpoint_needs_its_weights_and_a_tokenizer_that_loads(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    def said() -> str:
        return "\n".join(str(p) for p in preflight(f"model.path={tmp_path}") if "model.path" in p.keys)

    assert "has a config.json but no weights" in said() and "has no tokenizer" in said()
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "no weights" not in said() and "has no tokenizer" in said()
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    assert "does not load" in said()
    (tmp_path / "tokenizer.json").unlink()
    build_tiny_tokenizer().save_pretrained(tmp_path)
    assert [p for p in preflight(f"model.path={tmp_path}") if "model.path" in p.keys] == []


def test_output_dir_must_be_a_writable_directory(tmp_path):
    (tmp_path / "file").write_text("")
    assert only(preflight(f"output_dir={tmp_path}/file/runs"), "output_dir", "is a file, not a directory")
    assert only(preflight("output_dir=/proc/sys/runs"), "output_dir", "/proc/sys cannot hold a new file")
    assert preflight(f"output_dir={tmp_path}/new/runs") == []
    assert not (tmp_path / "new").exists()  # the check makes nothing


# ---- numbers --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("train.lr=nan", "train.lr"), ("train.lr=inf", "train.lr"), ("rollout.temperature=-inf", "rollout.temperature"),
    ("train.adam_eps=nan", "train.adam_eps"), ("save_every_minutes=inf", "save_every_minutes"),
])
def test_non_finite_numbers_are_refused(override, key):
    error = problems(override)
    assert any(p.keys == (key,) and "must be finite" in str(p) for p in error.problems), str(error)


@pytest.mark.parametrize("overrides, key, fragment", [
    (("train.min_lr=1e-3", "train.lr=1e-4"), "train.min_lr", "the decay would raise the learning rate"),
    (("train.lr_warmup_steps=200",), "train.lr_warmup_steps", "never reaches train.lr"),
])
def test_contradicting_fields_are_refused(overrides, key, fragment):
    error = problems(*overrides)
    assert any(key in p.keys and fragment in str(p) for p in error.problems), str(error)


def test_launch_exits_2_naming_the_key_and_starts_nothing(tmp_path):
    empty = rows(tmp_path / "empty.jsonl")
    out = subprocess.run([sys.executable, str(PROJECT_ROOT / "launch.py"), *JSONL, f"data.path={empty}",
                          f"output_dir={tmp_path}/runs", "run_name=r"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "[data.path]" in out.stderr and "has no rows" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("evals, key, fragment", [
    ("[{name: a/../b}]", "data.eval.0.name", "is not a plain name"),
    ("[{name: x},{name: x}]", "data.eval.1.name", "would overwrite the first's"),
])
def test_eval_names_are_plain_and_unique(evals, key, fragment):
    error = problems(f"data.eval={evals}")
    assert any(p.keys == (key,) and fragment in str(p) for p in error.problems), str(error)


@pytest.mark.parametrize("overrides, key, fragment", [
    (('output_dir="~/runs"',), "output_dir", "write the path in full: output_dir=$HOME/runs"),
    (("data=jsonl", 'data.path="~/train.jsonl"', "data.max_prompt_tokens=64"), "data.path", "starts with '~'"),
    (("rollout.temperature=0",), "rollout.temperature", "the 8 responses of a prompt are the same"),
])
def test_silent_nonsense_is_refused(overrides, key, fragment):
    error = problems(*overrides)
    assert any(key in p.keys and fragment in str(p) for p in error.problems), str(error)


def test_a_huge_parquet_row_is_a_bad_row_and_the_file_is_read_in_batches(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(2500)]
    rows[1500]["prompt"] = "x" * (2 << 20)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000)
    text = only(preflight("data=jsonl", f"data.path={path}", "data.max_prompt_tokens=64"), "data.on_bad_line",
                "row 1501: longer than data.max_row_bytes")
    assert "1 malformed row(s) in all 2500 rows" in text
    kept = load_prompt_file(str(path), build_tiny_tokenizer(), on_bad_line="skip", row_start=1499, row_end=1503)
    assert [r.row for r in kept.records] == [1499, 1501, 1502] and kept.stats.skipped == {"too_large": 1}


def test_a_reward_that_does_not_return_neither_holds_the_launch_nor_passes_its_timeout(plugins, monkeypatch, capsys):
    """Past reward.timeout_s the run would score 0: refused. A reward slower than the pre-flight's own bound but
    within its timeout (a first call may load a model) is only warned about; its thread is a daemon."""
    from slime_hydra.config import plugins as preflight_plugins

    plugins("import time\ndef score(response, label, metadata):\n    time.sleep(60)\n    return 1.0\n")
    assert only(preflight("reward=custom", "reward.target=plug.score", "reward.timeout_s=0.5"), "reward.timeout_s",
                "took over reward.timeout_s=0.5 s")
    monkeypatch.setattr(preflight_plugins, "CALL_BOUND_S", 0.5)
    assert preflight("reward=custom", "reward.target=plug.score") == []
    assert "did not return within 0.5 s on the data's first row" in capsys.readouterr().err
