"""Prompt datasets: rows from JSONL or Parquet (or a built-in task) become tokenized ``PromptRecord``s.

What a row must hold (keys are configurable, ``DataConfig``):

    prompt_key    a string, or a list of {"role": str, "content": str} chat messages
    label_key     the reference answer (any JSON value, null allowed)
    metadata_key  (optional) a dict, or null for {}
    tools_key     (optional) a list of tool specs given to the chat template, or null for none
    response_key  (algo=sft only) the target response, a string: trained on as the tokens after the rendered
                  prompt, with the tokenizer's EOS appended (as an engine's answer ends); a built-in task's rows
                  get their task's solution. algo=dpo: the chosen response
    rejected_key  (algo=dpo only) the rejected response, tokenized the same way; a built-in task's rows get the
                  solution of a wrong answer (``wrong_label``: the label off by 1-9)

Rows are numbered from 0 in file order (JSONL: row k is line k + 1; blank lines are rows too, so numbers match
the editor's) and ``row_start``/``row_end`` slice them before anything is parsed: a bad line outside the slice is
never looked at. A malformed row either stops the load (``on_bad_line="error"``: the error names the file, the
1-based line and what is wrong) or is skipped and counted by reason (``"skip"``). Prompts longer than
``max_prompt_tokens`` are dropped and counted. Every row in the slice ends up in exactly one count of
``DatasetStats``: kept, too_long, or skipped[reason].

Tokenization: with ``apply_chat_template`` the prompt (a plain string becomes one user message) is rendered with
the tokenizer's template and ``add_generation_prompt=True``, then encoded without adding special tokens (the
template already wrote them); without it, a string prompt is encoded as-is with the tokenizer's own special
tokens (e.g. a BOS), and a message list is a bad row.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from slime_hydra.data.config import MAX_LEVELS, ON_BAD_LINE, DataConfig, EvalDataConfig

BAD_REASONS = ("blank_line", "invalid_json", "not_utf8", "too_large", "missing_key", "wrong_type", "template_error")
"""Reasons a row is skipped, the keys of DatasetStats.skipped."""
_EXAMPLES_KEPT = 5
ENCODE_CHUNK = 1024
"""Rows tokenized in one call at most ..."""
ENCODE_CHARS = 1 << 22
"""... and characters (4 Mi): a tokenizer call holds ~300 bytes per character at its peak."""


def _chunks(texts: list[str]) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of ``texts`` to tokenize at once: at most ENCODE_CHUNK rows and, but for a single
    longer text, ENCODE_CHARS characters."""
    start, chars = 0, 0
    for i, text in enumerate(texts):
        if i > start and (i - start >= ENCODE_CHUNK or chars + len(text) > ENCODE_CHARS):
            yield start, i
            start, chars = i, 0
        chars += len(text)
    if start < len(texts):
        yield start, len(texts)


class BadLineError(ValueError):
    """A malformed dataset row, with where it is (path, 1-based line or row) and why (reason, detail)."""

    def __init__(self, path: str, line: int, reason: str, detail: str, unit: str = "line"):
        self.path, self.line, self.reason, self.detail = path, line, reason, detail
        self.where_what = f"{path}, {unit} {line}: {detail}"
        """The message without the hint, as kept in DatasetStats.skipped_examples."""
        super().__init__(f"{self.where_what} (or set data.on_bad_line=skip to skip and count such rows)")


@dataclass
class PromptRecord:
    """One prompt ready for the rollout."""

    row: int
    """0-based row of the source (JSONL line - 1, Parquet row, task row)."""
    prompt: Any
    """The prompt as the row gave it: a string or a list of chat messages."""
    text: str
    """The prompt text the model sees (after the chat template, if applied)."""
    token_ids: list[int]
    """Token ids of ``text``."""
    label: Any = None
    """Reference answer for the reward."""
    metadata: dict = field(default_factory=dict)
    """Extras for the reward (empty unless data.metadata_key is set)."""
    tools: Optional[list] = None
    """Tool specs given to the chat template (None unless data.tools_key is set)."""
    response_ids: Optional[list[int]] = None
    """algo=sft: the target response's token ids, EOS last (None for a prompt to sample from); algo=dpo: the
    chosen response's."""
    rejected_ids: Optional[list[int]] = None
    """algo=dpo: the rejected response's token ids, EOS last."""

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.token_ids)


@dataclass
class DatasetStats:
    """What happened to every row of the selected slice: kept + too_long + response_too_long + sum(skipped) ==
    rows."""

    source: str
    """File path, or task:<name>/<split> for a built-in task."""
    rows: int = 0
    """Rows in the slice [row_start, row_end)."""
    kept: int = 0
    """Rows that became PromptRecords."""
    too_long: int = 0
    """Rows dropped because the prompt had more than max_prompt_tokens tokens."""
    response_too_long: int = 0
    """algo=sft: rows dropped because the response (with EOS) had more than rollout.max_response_tokens tokens."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Malformed rows skipped (on_bad_line=skip), by reason (BAD_REASONS)."""
    skipped_examples: list[str] = field(default_factory=list)
    """The first few skipped rows' messages (path:line: what was wrong), for the log."""
    max_prompt_tokens: Optional[int] = None
    """The limit applied (None: no limit)."""
    longest_prompt_tokens: int = 0
    """Longest prompt seen, in tokens, including dropped ones."""

    @property
    def num_skipped(self) -> int:
        """Malformed rows skipped, all reasons."""
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One log line: rows read, kept, and every drop with its count."""
        parts = [f"{self.source}: {self.kept}/{self.rows} prompts kept"]
        if self.too_long:
            parts.append(f"{self.too_long} longer than {self.max_prompt_tokens} tokens "
                         f"(longest {self.longest_prompt_tokens})")
        if self.response_too_long:
            parts.append(f"{self.response_too_long} with a response longer than rollout.max_response_tokens")
        for reason, n in sorted(self.skipped.items()):
            parts.append(f"{n} skipped ({reason})")
        return ", ".join(parts)


@dataclass
class PromptDataset:
    """The records and the stats of one load."""

    records: list[PromptRecord]
    stats: DatasetStats

    def __len__(self) -> int:
        return len(self.records)


@dataclass
class _Row:
    row: int
    prompt: Any
    label: Any
    metadata: dict
    tools: Optional[list]
    responses: tuple[str, ...] = ()


def response_keys(cfg: DataConfig, max_response_tokens: Optional[int], rejected: bool) -> tuple[str, ...]:
    """The row keys of the responses each record carries: none for sampling, the response (algo=sft: a
    ``max_response_tokens``), and the rejected one after it (algo=dpo: ``rejected``)."""
    if max_response_tokens is None:
        return ()
    return (cfg.response_key, cfg.rejected_key) if rejected else (cfg.response_key,)


def wrong_label(label: Any, row: int) -> str:
    """A built-in task's rejected answer for algo=dpo: an integer label moved by 1-9 (never below 0), the offset
    and its sign fixed by the row number, so a run's pairs are the same every time."""
    try:
        value = int(label)
    except (TypeError, ValueError):
        raise ValueError(f"algo=dpo makes a built-in task's rejected answers from integer labels; got {label!r}: "
                         "use a file with data.response_key and data.rejected_key") from None
    offset = 1 + (row * 7919) % 9
    return str(value + offset if row % 2 or value < offset else value - offset)


def load_prompts(cfg: DataConfig, tokenizer, max_response_tokens: Optional[int] = None,
                 rejected: bool = False) -> PromptDataset:
    """The training prompts of ``cfg``: its file (``cfg.path``), or the built-in task's train split. With
    ``max_response_tokens`` (algo=sft) every record has its response too: the file's ``cfg.response_key``, or the
    task's solution of each row (``task.solution``); with ``rejected`` (algo=dpo) also the rejected one
    (``cfg.rejected_key``, or the solution of ``wrong_label``)."""
    keys = response_keys(cfg, max_response_tokens, rejected)
    if cfg.path is not None:
        return load_prompt_file(
            cfg.path, tokenizer, prompt_key=cfg.prompt_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
            tools_key=cfg.tools_key, apply_chat_template=cfg.apply_chat_template,
            max_prompt_tokens=cfg.max_prompt_tokens, row_start=cfg.row_start, row_end=cfg.row_end,
            on_bad_line=cfg.on_bad_line, max_row_bytes=cfg.max_row_bytes, response_keys=keys,
            max_response_tokens=max_response_tokens)
    return _load_task(cfg, tokenizer, "train", cfg.row_start, cfg.row_end, max_response_tokens, keys)


def load_eval_prompts(eval_cfg: EvalDataConfig, cfg: DataConfig, tokenizer,
                      max_response_tokens: Optional[int] = None, rejected: bool = False) -> PromptDataset:
    """One eval dataset: its own file with the training keys, or the task's held-out split; first max_prompts rows.
    ``max_response_tokens`` (algo=sft's held-out loss), ``rejected``: with their responses, as ``load_prompts``."""
    keys = response_keys(cfg, max_response_tokens, rejected)
    if eval_cfg.path is not None:
        return load_prompt_file(
            eval_cfg.path, tokenizer, prompt_key=cfg.prompt_key, label_key=cfg.label_key,
            metadata_key=cfg.metadata_key, tools_key=cfg.tools_key, apply_chat_template=cfg.apply_chat_template,
            max_prompt_tokens=cfg.max_prompt_tokens, row_start=0, row_end=eval_cfg.max_prompts,
            on_bad_line=cfg.on_bad_line, max_row_bytes=cfg.max_row_bytes, response_keys=keys,
            max_response_tokens=max_response_tokens)
    return _load_task(cfg, tokenizer, "eval", 0, eval_cfg.max_prompts, max_response_tokens, keys)


def _load_task(cfg: DataConfig, tokenizer, split: str, row_start: int, row_end: Optional[int],
               max_response_tokens: Optional[int] = None, keys: tuple[str, ...] = ()) -> PromptDataset:
    from slime_hydra.data.tasks import Environment, get_task

    if cfg.task is None:
        raise ValueError("data.path and data.task are both null; set data.path=<file.jsonl> or data.task=addition")
    task = get_task(cfg.task)
    if isinstance(task, Environment):
        rows = task.rows(split, seed=cfg.seed, levels=task_levels(cfg, split))
    else:
        rows = task.rows(split, seed=cfg.seed)
    if keys:  # each problem with its worked solution (what the task's own SFT rows hold), dpo: and a wrong one
        rows = [{**row, "response": task.solution(row["label"], row["metadata"])} for row in rows]
    if len(keys) == 2:
        rows = [{**row, "rejected": task.solution(wrong_label(row["label"], i), row["metadata"])}
                for i, row in enumerate(rows)]
    return load_prompt_rows(
        rows, tokenizer, source=f"task:{cfg.task}/{split}", metadata_key="metadata",
        apply_chat_template=cfg.apply_chat_template, max_prompt_tokens=cfg.max_prompt_tokens,
        row_start=row_start, row_end=row_end, on_bad_line="error", response_keys=("response", "rejected")[:len(keys)],
        max_response_tokens=max_response_tokens)


def task_levels(cfg: DataConfig, split: str) -> list[int]:
    """Levels of an environment's fixed rows: data.level (or the task's default) for both splits; with adaptive
    difficulty, every level the sampler may reach, for the held-out split (training prompts are generated)."""
    from slime_hydra.data.tasks import get_env

    env = get_env(cfg.task)
    if cfg.adaptive.enabled and split == "eval":
        return list(range(cfg.adaptive.min_level, min(env.max_level, cfg.adaptive.max_level or env.max_level) + 1))
    return [cfg.level or env.default_level]


def sft_levels(cfg: DataConfig) -> Optional[list[int]]:
    """Levels the warm start of a built model draws its SFT rows from (model/warm_start.py): every level the run
    may train at: 1..data.level (or the task's default) for a fixed level; with adaptive difficulty, the held-out
    levels (min_level up to the highest data.task may reach). None for a task without levels (addition) or none."""
    if cfg.task not in MAX_LEVELS:
        return None
    if cfg.adaptive.enabled:
        return task_levels(cfg, "eval")
    return list(range(1, task_levels(cfg, "train")[0] + 1))


def load_prompt_file(path: str, tokenizer, *, prompt_key: str = "prompt", label_key: str = "label",
                     metadata_key: Optional[str] = None, tools_key: Optional[str] = None,
                     apply_chat_template: bool = True, max_prompt_tokens: Optional[int] = None, row_start: int = 0,
                     row_end: Optional[int] = None, on_bad_line: str = "error",
                     max_row_bytes: int = 1 << 20, response_keys: tuple[str, ...] = (),
                     max_response_tokens: Optional[int] = None) -> PromptDataset:
    """Load a .jsonl or .parquet prompt file (see the module docstring for row rules and counting).

    max_prompt_tokens: prompts with more tokens than this are dropped and counted; None keeps all.
    row_start, row_end: 0-based half-open row slice; row_end None means to the end of the file.
    Raises BadLineError (on_bad_line="error") and ValueError when no prompt is left.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        raw, unit = jsonl_rows(path, row_start, row_end, max_row_bytes), "line"
    elif suffix == ".parquet":
        raw, unit = parquet_rows(path, row_start, row_end, max_row_bytes), "row"
    else:
        raise ValueError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl or .parquet")
    return _build(raw, tokenizer, str(path), unit, prompt_key, label_key, metadata_key, tools_key,
                  apply_chat_template, max_prompt_tokens, on_bad_line, response_keys, max_response_tokens)


def load_prompt_rows(rows: list[dict], tokenizer, *, source: str = "rows", prompt_key: str = "prompt",
                     label_key: str = "label", metadata_key: Optional[str] = None, tools_key: Optional[str] = None,
                     apply_chat_template: bool = True, max_prompt_tokens: Optional[int] = None, row_start: int = 0,
                     row_end: Optional[int] = None, on_bad_line: str = "error", response_keys: tuple[str, ...] = (),
                     max_response_tokens: Optional[int] = None) -> PromptDataset:
    """Same as ``load_prompt_file`` for rows already in memory (built-in tasks); errors name ``source`` and row + 1."""
    _check_slice(row_start, row_end)
    raw = ((i, row, None) for i, row in enumerate(rows[row_start:row_end], start=row_start))
    return _build(raw, tokenizer, source, "row", prompt_key, label_key, metadata_key, tools_key,
                  apply_chat_template, max_prompt_tokens, on_bad_line, response_keys, max_response_tokens)


def _check_slice(row_start: int, row_end: Optional[int]) -> None:
    if row_start < 0 or (row_end is not None and row_end < row_start):
        raise ValueError(f"data.row_start={row_start}, data.row_end={row_end}: need 0 <= row_start <= row_end")


def _lines(f, max_bytes: int) -> Iterator[Optional[bytes]]:
    """Each line of the binary file ``f`` (without its newline), or None for a line over ``max_bytes``, which is
    read past in 1 MiB pieces and never held whole. ``for line in f`` would hold a whole line, however long."""
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        if line.endswith(b"\n") or len(line) <= max_bytes:
            yield line.rstrip(b"\n")
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(1 << 20)
        yield None


def jsonl_rows(path: str, row_start: int, row_end: Optional[int],
                max_row_bytes: int = 1 << 20) -> Iterator[tuple[int, Any, Optional[tuple]]]:
    """(row, parsed value or None, (reason, detail) or None) for each line in the slice; lines are read at most
    ``max_row_bytes`` at a time (data.max_row_bytes)."""
    _check_slice(row_start, row_end)
    with open(path, "rb") as f:
        for i, raw in enumerate(_lines(f, max_row_bytes)):
            if i < row_start:
                continue
            if row_end is not None and i >= row_end:
                break
            if raw is None:
                yield i, None, ("too_large", f"longer than data.max_row_bytes={max_row_bytes:,} bytes (raise it, or "
                                             "shorten the row)")
                continue
            try:
                line = raw.decode("utf-8-sig" if i == 0 else "utf-8")  # a byte-order mark may open the file
            except UnicodeDecodeError as e:
                yield i, None, ("not_utf8", f"not UTF-8 (byte {e.start + 1}: {raw[e.start:e.start + 1]!r})")
                continue
            if not line.strip():
                yield i, None, ("blank_line", "blank line")
                continue
            try:
                yield i, json.loads(line), None
            except (json.JSONDecodeError, RecursionError) as e:
                what = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
                yield i, None, ("invalid_json", f"invalid JSON ({what})")


def parquet_rows(path: str, row_start: int, row_end: Optional[int],
                  max_row_bytes: int = 1 << 20) -> Iterator[tuple[int, Any, Optional[tuple]]]:
    """Like ``jsonl_rows`` for a Parquet file, read in batches of 1,024 rows (never the whole table: memory holds
    one batch); a row longer than ``max_row_bytes`` as JSON is a too_large row, as it would be in a JSONL file."""
    import pyarrow.parquet as pq

    _check_slice(row_start, row_end)
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        if row + batch.num_rows <= row_start:
            row += batch.num_rows
            continue
        for offset in range(batch.num_rows):
            if row_end is not None and row >= row_end:
                return
            if row >= row_start:
                value = batch.slice(offset, 1).to_pylist()[0]
                if len(json.dumps(value, default=str).encode()) > max_row_bytes:
                    yield row, None, ("too_large", f"longer than data.max_row_bytes={max_row_bytes:,} bytes (raise "
                                                   "it, or shorten the row)")
                else:
                    yield row, value, None
            row += 1


class RowProblem(Exception):
    """What is wrong with one row: a reason of BAD_REASONS and the detail (the caller adds where)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def parse_row(value: Any, prompt_key: str, label_key: str, metadata_key: Optional[str],
           tools_key: Optional[str], apply_chat_template: bool) -> tuple[Any, Any, dict, Optional[list]]:
    """(prompt, label, metadata, tools) of one row; raises RowProblem(reason, detail)."""
    if not isinstance(value, dict):
        raise RowProblem("wrong_type", f"row is a JSON {type(value).__name__}, expected an object")
    for key, what in ((prompt_key, "prompt"), (label_key, "label"), (metadata_key, "metadata"), (tools_key, "tools")):
        if key is not None and key not in value:
            raise RowProblem("missing_key", f"missing {what} key {key!r} (row keys: {sorted(value)})")
    prompt = value[prompt_key]
    if isinstance(prompt, list):
        bad = [m for m in prompt if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                          and isinstance(m.get("content"), str))]
        if bad or not prompt:
            raise RowProblem("wrong_type", f"{prompt_key!r} is a list but not of {{role: str, content: str}} messages")
        if not apply_chat_template:
            raise RowProblem("wrong_type", f"{prompt_key!r} holds chat messages but data.apply_chat_template=false")
    elif not isinstance(prompt, str):
        raise RowProblem("wrong_type", f"{prompt_key!r} holds a {type(prompt).__name__}; expected a string or a list "
                                 f"of chat messages")
    metadata = {} if metadata_key is None or value[metadata_key] is None else value[metadata_key]
    if not isinstance(metadata, dict):
        raise RowProblem("wrong_type", f"metadata key {metadata_key!r} holds a {type(metadata).__name__}; expected an "
                                       "object")
    tools = None if tools_key is None else value[tools_key]
    if tools is not None and not isinstance(tools, list):
        raise RowProblem("wrong_type", f"tools key {tools_key!r} holds a {type(tools).__name__}; expected a list")
    return prompt, value[label_key], metadata, tools


def parse_response(value: dict, response_key: str) -> str:
    """algo=sft: the row's target response; raises RowProblem when it is missing or not a string."""
    if response_key not in value:
        raise RowProblem("missing_key", f"missing response key {response_key!r} (row keys: {sorted(value)})")
    if not isinstance(value[response_key], str):
        what = type(value[response_key]).__name__
        raise RowProblem("wrong_type", f"response key {response_key!r} holds a {what}; expected a string")
    return value[response_key]


def render_row(prompt: Any, tools: Optional[list], tokenizer, apply_chat_template: bool) -> str:
    if not apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # template errors come as jinja/ValueError/TypeError; all mean this row cannot render
        raise RowProblem("template_error", f"chat template failed: {type(e).__name__}: {e}") from e


def _build(raw: Iterator[tuple[int, Any, Optional[tuple]]], tokenizer, source: str, unit: str, prompt_key: str,
           label_key: str, metadata_key: Optional[str], tools_key: Optional[str], apply_chat_template: bool,
           max_prompt_tokens: Optional[int], on_bad_line: str, response_keys: tuple[str, ...] = (),
           max_response_tokens: Optional[int] = None) -> PromptDataset:
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"data.on_bad_line={on_bad_line!r}; choose one of {', '.join(ON_BAD_LINE)}")
    stats = DatasetStats(source=source, max_prompt_tokens=max_prompt_tokens)
    parsed: list[tuple[_Row, str]] = []
    for row, value, problem in raw:
        stats.rows += 1
        try:
            if problem is not None:
                raise RowProblem(*problem)
            prompt, label, metadata, tools = parse_row(value, prompt_key, label_key, metadata_key, tools_key,
                                                    apply_chat_template)
            responses = tuple(parse_response(value, key) for key in response_keys)
            parsed.append((_Row(row, prompt, label, metadata, tools, responses),
                           render_row(prompt, tools, tokenizer, apply_chat_template)))
        except RowProblem as bad:
            error = BadLineError(source, row + 1, bad.reason, bad.detail, unit)
            if on_bad_line == "error":
                raise error from None
            stats.skipped[bad.reason] = stats.skipped.get(bad.reason, 0) + 1
            if len(stats.skipped_examples) < _EXAMPLES_KEPT:
                stats.skipped_examples.append(error.where_what)

    records = []
    add_special_tokens = not apply_chat_template
    for start, stop in _chunks([text for _, text in parsed]):
        chunk = parsed[start:stop]
        ids = tokenizer([text for _, text in chunk], add_special_tokens=add_special_tokens)["input_ids"]
        answers = [[] for _ in chunk]  # per row, each response's tokens as an engine's answer ends: with EOS
        for k in range(len(response_keys)):
            encoded = tokenizer([r.responses[k] for r, _ in chunk], add_special_tokens=False)["input_ids"]
            for answer, a in zip(answers, encoded):
                answer.append(a + [tokenizer.eos_token_id])
        for (r, text), token_ids, answer in zip(chunk, ids, answers):
            stats.longest_prompt_tokens = max(stats.longest_prompt_tokens, len(token_ids))
            if max_prompt_tokens is not None and len(token_ids) > max_prompt_tokens:
                stats.too_long += 1
                continue
            if max_response_tokens is not None and any(len(a) > max_response_tokens for a in answer):
                stats.response_too_long += 1
                continue
            records.append(PromptRecord(r.row, r.prompt, text, list(token_ids), r.label, r.metadata, r.tools,
                                        *answer))
    stats.kept = len(records)
    if not records:
        raise ValueError(f"no prompts left: {stats.summary()}"
                         + (f"; first problems: {stats.skipped_examples}" if stats.skipped_examples else ""))
    return PromptDataset(records, stats)
