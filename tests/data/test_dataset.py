"""Prompt datasets: JSONL/Parquet, configurable keys, chat template, slicing, length filter, bad-line handling."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime_hydra.data import BadLineError, load_eval_prompts, load_prompt_file, load_prompts
from slime_hydra.data.config import DataConfig, EvalDataConfig
from slime_hydra.model.tiny import build_tiny_tokenizer

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


ROWS = [
    {"question": "1+2=", "answer": "3", "extra": {"id": 0}},
    {"question": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}], "answer": "7",
     "extra": {"id": 1}},
    {"question": "10+20=", "answer": 30, "extra": None},
]
KEYS = dict(prompt_key="question", label_key="answer", metadata_key="extra")


def test_jsonl_with_keys_and_chat_template(tmp_path, tok):
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", ROWS), tok, **KEYS)
    a, b, c = ds.records
    assert a.text == CHAT.format("1+2=") and a.prompt == "1+2=" and a.label == "3" and a.metadata == {"id": 0}
    assert a.token_ids == tok.encode(a.text, add_special_tokens=False) and a.num_tokens == 4 + 19
    assert b.text == "<|im_start|>system\nAdd.<|im_end|>\n" + CHAT.format("3+4=") and b.prompt == ROWS[1]["question"]
    assert c.label == 30 and c.metadata == {} and c.tools is None  # null metadata becomes {}
    assert [r.row for r in ds.records] == [0, 1, 2]
    assert (ds.stats.rows, ds.stats.kept, ds.stats.too_long, ds.stats.num_skipped) == (3, 3, 0, 0)


def test_without_chat_template_the_string_is_the_prompt(tmp_path, tok):
    rows = [{"prompt": "5+6=", "label": "11"}]
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", rows), tok, apply_chat_template=False)
    assert ds.records[0].text == "5+6=" and ds.records[0].token_ids == tok.encode("5+6=", add_special_tokens=False)


def test_tools_are_given_to_the_template(tmp_path, tok):
    tools = [{"type": "function", "function": {"name": "add"}}]
    rows = [{"prompt": "2+2=", "label": "4", "tools": tools}]
    rec = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", rows), tok, tools_key="tools").records[0]
    assert rec.tools == tools
    assert rec.text == tok.apply_chat_template([{"role": "user", "content": "2+2="}], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
    assert rec.text.startswith("<|im_start|>system\n# Tools\n")


def test_parquet_gives_the_same_records_as_jsonl(tmp_path, tok):
    rows = [{"question": "1+2=", "answer": "3", "extra": {"id": 0}}, {"question": "4+5=", "answer": "9",
                                                                      "extra": {"id": 1}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_parquet = load_prompt_file(str(tmp_path / "p.parquet"), tok, **KEYS)
    from_jsonl = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", rows), tok, **KEYS)
    assert from_parquet.records == from_jsonl.records and len(from_parquet) == 2


def test_parquet_chat_messages_and_slicing(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "label": str(i + 1)} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    ds = load_prompt_file(str(tmp_path / "p.parquet"), tok, row_start=3, row_end=6)
    assert [r.label for r in ds.records] == ["4", "5", "6"] and [r.row for r in ds.records] == [3, 4, 5]
    assert ds.records[0].text == CHAT.format("3+1=")
    assert len(load_prompt_file(str(tmp_path / "p.parquet"), tok, row_start=8, row_end=100)) == 2


def test_row_slice_never_reads_rows_outside_it(tmp_path, tok):
    lines = ["{not json"] + [{"prompt": f"{i}+0=", "label": str(i)} for i in range(1, 6)] + ["also bad"]
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", lines), tok, row_start=1, row_end=6)
    assert [r.label for r in ds.records] == ["1", "2", "3", "4", "5"] and ds.stats.rows == 5
    assert [r.row for r in ds.records] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="row_start=4, data.row_end=2"):
        load_prompt_file(str(tmp_path / "p.jsonl"), tok, row_start=4, row_end=2)


def test_long_prompts_are_filtered_and_counted(tmp_path, tok):
    # the chat template adds 19 tokens, so prompts of 3, 5 and 8 characters are 22, 24 and 27 tokens
    rows = [{"prompt": p, "label": ""} for p in ("1+2", "12+34", "1234+567", "9+9")]
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", rows), tok, max_prompt_tokens=24)
    assert [r.prompt for r in ds.records] == ["1+2", "12+34", "9+9"]
    assert (ds.stats.too_long, ds.stats.longest_prompt_tokens, ds.stats.kept, ds.stats.rows) == (1, 27, 3, 4)
    assert "1 longer than 24 tokens (longest 27)" in ds.stats.summary()
    assert len(load_prompt_file(str(tmp_path / "p.jsonl"), tok, max_prompt_tokens=None)) == 4


GOOD = {"prompt": "1+1=", "label": "2"}
BAD_LINES = [
    ("{bad json", "invalid_json", "invalid JSON"),
    ("", "blank_line", "blank line"),
    ({"label": "2"}, "missing_key", "missing prompt key 'prompt'"),
    ({"prompt": "1+1="}, "missing_key", "missing label key 'label'"),
    ({"prompt": 12, "label": "2"}, "wrong_type", "'prompt' holds a int"),
    ({"prompt": [{"role": "user"}], "label": "2"}, "wrong_type", "not of {role: str, content: str} messages"),
    ("[1, 2]", "wrong_type", "row is a JSON list"),
]


@pytest.mark.parametrize("line,reason,message", BAD_LINES)
def test_bad_line_error_names_file_line_and_problem(tmp_path, tok, line, reason, message):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, GOOD, line, GOOD])
    with pytest.raises(BadLineError) as info:
        load_prompt_file(path, tok)
    assert info.value.line == 3 and info.value.reason == reason and info.value.path == path
    assert str(info.value).startswith(f"{path}, line 3: ") and message in str(info.value)
    assert "data.on_bad_line=skip" in str(info.value)


def test_bad_lines_skipped_and_counted_by_reason(tmp_path, tok):
    lines = [GOOD] + [line for line, _, _ in BAD_LINES] + [GOOD, {"prompt": "1" * 40, "label": "x"}]
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", lines), tok, on_bad_line="skip", max_prompt_tokens=40)
    s = ds.stats
    assert len(ds) == 2 and s.rows == 10 and s.too_long == 1
    assert s.skipped == {"invalid_json": 1, "blank_line": 1, "missing_key": 2, "wrong_type": 3}
    assert s.kept + s.too_long + s.num_skipped == s.rows
    assert len(s.skipped_examples) == 5 and s.skipped_examples[0].endswith(", line 2: invalid JSON "
                                                                           "(Expecting property name enclosed in "
                                                                           "double quotes at column 2)")
    assert [r.row for r in ds.records] == [0, 8]


def test_messages_without_chat_template_and_metadata_type_are_bad_rows(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "x"}], "label": "", "m": {}}]
    with pytest.raises(BadLineError, match="holds chat messages but data.apply_chat_template=false"):
        load_prompt_file(write_jsonl(tmp_path / "a.jsonl", rows), tok, apply_chat_template=False)
    rows = [GOOD | {"m": [1]}]
    with pytest.raises(BadLineError, match="metadata key 'm' holds a list; expected an object"):
        load_prompt_file(write_jsonl(tmp_path / "b.jsonl", rows), tok, metadata_key="m")
    with pytest.raises(BadLineError, match="missing metadata key 'm'"):
        load_prompt_file(write_jsonl(tmp_path / "c.jsonl", [GOOD]), tok, metadata_key="m")


def test_chat_template_failure_is_a_bad_row(tmp_path):
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% if messages[0]['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}x"
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, {"prompt": "boom", "label": ""}])
    with pytest.raises(BadLineError, match="line 2: chat template failed: .*no boom"):
        load_prompt_file(path, tok)
    assert load_prompt_file(path, tok, on_bad_line="skip").stats.skipped == {"template_error": 1}


def test_parquet_bad_row_names_the_row(tmp_path, tok):
    pq.write_table(pa.Table.from_pylist([GOOD, {"prompt": None, "label": "2"}]), tmp_path / "p.parquet")
    with pytest.raises(BadLineError, match=r"p.parquet, row 2: 'prompt' holds a NoneType"):
        load_prompt_file(str(tmp_path / "p.parquet"), tok)


def test_nothing_left_and_bad_options_raise(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", ["nope", "nope"])
    with pytest.raises(ValueError, match=r"no prompts left: .*0/2 prompts kept, 2 skipped \(invalid_json\)"):
        load_prompt_file(path, tok, on_bad_line="skip")
    with pytest.raises(ValueError, match="data.on_bad_line='warn'"):
        load_prompt_file(path, tok, on_bad_line="warn")
    with pytest.raises(ValueError, match="unsupported prompt file type '.csv'"):
        load_prompt_file(str(tmp_path / "p.csv"), tok)


def test_load_prompts_from_config_file_and_builtin_task(tmp_path, tok):
    cfg = DataConfig(path=write_jsonl(tmp_path / "p.jsonl", ROWS), **KEYS, row_start=1)
    assert [r.label for r in load_prompts(cfg, tok).records] == ["7", 30]

    task = load_prompts(DataConfig(path=None, task="addition", row_end=100), tok)
    assert len(task) == 100 and task.stats.source == "task:addition/train"
    r = task.records[0]
    assert r.text == CHAT.format(r.prompt) and r.label == str(r.metadata["a"] + r.metadata["b"])
    full = load_prompts(DataConfig(), tok)
    assert len(full) == 9000 and full.stats.too_long == 0

    held = load_eval_prompts(EvalDataConfig(max_prompts=50), DataConfig(), tok)
    assert len(held) == 50 and held.stats.source == "task:addition/eval"
    assert not {x.prompt for x in held.records} & {x.prompt for x in full.records}

    eval_file = write_jsonl(tmp_path / "e.jsonl", ROWS)
    assert len(load_eval_prompts(EvalDataConfig(path=eval_file, max_prompts=2), cfg, tok)) == 2


def test_sft_rows_carry_their_response_tokens_and_eos(tmp_path, tok):
    """algo=sft: each record's response is tokenized without special tokens, EOS last; a response over
    max_response_tokens drops its row (counted); a row without a string response is a bad line naming the key."""
    rows = [{"prompt": "1+2=", "label": "3", "response": "3"}, {"prompt": "10+20=", "label": "30", "response": "30"},
            {"prompt": "7+8=", "label": "15", "response": "15 and some more"}]
    ds = load_prompt_file(write_jsonl(tmp_path / "s.jsonl", rows), tok, response_keys=("response",),
                          max_response_tokens=4)
    assert [r.response_ids for r in ds.records] == [tok.encode("3", add_special_tokens=False) + [tok.eos_token_id],
                                                    tok.encode("30", add_special_tokens=False) + [tok.eos_token_id]]
    assert (ds.stats.rows, ds.stats.kept, ds.stats.response_too_long) == (3, 2, 1)
    assert "1 with a response longer than rollout.max_response_tokens" in ds.stats.summary()
    assert load_prompt_file(write_jsonl(tmp_path / "s.jsonl", rows), tok).records[0].response_ids is None
    bad = write_jsonl(tmp_path / "b.jsonl", [rows[0], {"prompt": "1+1=", "label": "2"},
                                             {"prompt": "2+2=", "label": "4", "response": 4}])
    with pytest.raises(BadLineError, match=r"b.jsonl, line 2: missing response key 'response'"):
        load_prompt_file(bad, tok, response_keys=("response",))
    skipped = load_prompt_file(bad, tok, response_keys=("response",), on_bad_line="skip")
    assert skipped.stats.skipped == {"missing_key": 1, "wrong_type": 1} and skipped.stats.kept == 1


def test_sft_on_a_builtin_task_trains_on_its_solutions(tok):
    """Each problem of the split with its task's solution (addition's: the answer), EOS last; eval rows too."""
    ds = load_prompts(DataConfig(path=None, task="addition", row_end=100), tok, max_response_tokens=8)
    held = load_eval_prompts(EvalDataConfig(max_prompts=20), DataConfig(), tok, max_response_tokens=8)
    assert len(ds) == 100 and ds.stats.source == "task:addition/train" and len(held) == 20
    for r in ds.records + held.records:
        a, b = (int(x) for x in r.prompt.rstrip("=").split("+"))
        assert tok.decode(r.response_ids[:-1]) == str(a + b) == r.label and r.response_ids[-1] == tok.eos_token_id
