"""Prompt datasets: rows from JSONL or Parquet (or a built-in task) become tokenized ``PromptRecord``s.

What a row must hold (keys are configurable, ``DataConfig``):

    prompt_key    a string, or a list of {"role": str, "content": str} chat messages
    label_key     the reference answer (any JSON value, null allowed)
    metadata_key  (optional) a dict, or null for {}
    tools_key     (optional) a list of tool specs given to the chat template, or null for none

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
_ENCODE_CHUNK = 1024
"""Rows tokenized in one call at most ..."""
_ENCODE_CHARS = 1 << 22
"""... and characters (4 Mi): a tokenizer call holds ~300 bytes per character at its peak."""


def _chunks(texts: list[str]) -> Iterator[tuple[int, int]]:
    """[start, stop) ranges of ``texts`` to tokenize at once: at most _ENCODE_CHUNK rows and, but for a single
    longer text, _ENCODE_CHARS characters."""
    start, chars = 0, 0
    for i, text in enumerate(texts):
        if i > start and (i - start >= _ENCODE_CHUNK or chars + len(text) > _ENCODE_CHARS):
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

    @property
    def num_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.token_ids)


@dataclass
class DatasetStats:
    """What happened to every row of the selected slice: kept + too_long + sum(skipped) == rows."""

    source: str
    """File path, or task:<name>/<split> for a built-in task."""
    rows: int = 0
    """Rows in the slice [row_start, row_end)."""
    kept: int = 0
    """Rows that became PromptRecords."""
    too_long: int = 0
    """Rows dropped because the prompt had more than max_prompt_tokens tokens."""
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


def load_prompts(cfg: DataConfig, tokenizer) -> PromptDataset:
    """The training prompts of ``cfg``: its file (``cfg.path``), or the built-in task's train split."""
    if cfg.path is not None:
        return load_prompt_file(
            cfg.path, tokenizer, prompt_key=cfg.prompt_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
            tools_key=cfg.tools_key, apply_chat_template=cfg.apply_chat_template,
            max_prompt_tokens=cfg.max_prompt_tokens, row_start=cfg.row_start, row_end=cfg.row_end,
            on_bad_line=cfg.on_bad_line, max_row_bytes=cfg.max_row_bytes)
    return _load_task(cfg, tokenizer, "train", cfg.row_start, cfg.row_end)


def load_eval_prompts(eval_cfg: EvalDataConfig, cfg: DataConfig, tokenizer) -> PromptDataset:
    """One eval dataset: its own file with the training keys, or the task's held-out split; first max_prompts rows."""
    if eval_cfg.path is not None:
        return load_prompt_file(
            eval_cfg.path, tokenizer, prompt_key=cfg.prompt_key, label_key=cfg.label_key,
            metadata_key=cfg.metadata_key, tools_key=cfg.tools_key, apply_chat_template=cfg.apply_chat_template,
            max_prompt_tokens=cfg.max_prompt_tokens, row_start=0, row_end=eval_cfg.max_prompts,
            on_bad_line=cfg.on_bad_line, max_row_bytes=cfg.max_row_bytes)
    return _load_task(cfg, tokenizer, "eval", 0, eval_cfg.max_prompts)


def _load_task(cfg: DataConfig, tokenizer, split: str, row_start: int, row_end: Optional[int]) -> PromptDataset:
    from slime_hydra.data.tasks import Environment, get_task

    if cfg.task is None:
        raise ValueError("data.path and data.task are both null; set data.path=<file.jsonl> or data.task=addition")
    task = get_task(cfg.task)
    if isinstance(task, Environment):
        rows = task.rows(split, seed=cfg.seed, levels=task_levels(cfg, split))
    else:
        rows = task.rows(split, seed=cfg.seed)
    return load_prompt_rows(
        rows, tokenizer, source=f"task:{cfg.task}/{split}", metadata_key="metadata",
        apply_chat_template=cfg.apply_chat_template, max_prompt_tokens=cfg.max_prompt_tokens,
        row_start=row_start, row_end=row_end, on_bad_line="error")


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
                     max_row_bytes: int = 1 << 20) -> PromptDataset:
    """Load a .jsonl or .parquet prompt file (see the module docstring for row rules and counting).

    max_prompt_tokens: prompts with more tokens than this are dropped and counted; None keeps all.
    row_start, row_end: 0-based half-open row slice; row_end None means to the end of the file.
    Raises BadLineError (on_bad_line="error") and ValueError when no prompt is left.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        raw, unit = _jsonl_rows(path, row_start, row_end, max_row_bytes), "line"
    elif suffix == ".parquet":
        raw, unit = _parquet_rows(path, row_start, row_end, max_row_bytes), "row"
    else:
        raise ValueError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl or .parquet")
    return _build(raw, tokenizer, str(path), unit, prompt_key, label_key, metadata_key, tools_key,
                  apply_chat_template, max_prompt_tokens, on_bad_line)


def load_prompt_rows(rows: list[dict], tokenizer, *, source: str = "rows", prompt_key: str = "prompt",
                     label_key: str = "label", metadata_key: Optional[str] = None, tools_key: Optional[str] = None,
                     apply_chat_template: bool = True, max_prompt_tokens: Optional[int] = None, row_start: int = 0,
                     row_end: Optional[int] = None, on_bad_line: str = "error") -> PromptDataset:
    """Same as ``load_prompt_file`` for rows already in memory (built-in tasks); errors name ``source`` and row + 1."""
    _check_slice(row_start, row_end)
    raw = ((i, row, None) for i, row in enumerate(rows[row_start:row_end], start=row_start))
    return _build(raw, tokenizer, source, "row", prompt_key, label_key, metadata_key, tools_key,
                  apply_chat_template, max_prompt_tokens, on_bad_line)


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


def _jsonl_rows(path: str, row_start: int, row_end: Optional[int],
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


def _parquet_rows(path: str, row_start: int, row_end: Optional[int],
                  max_row_bytes: int = 1 << 20) -> Iterator[tuple[int, Any, Optional[tuple]]]:
    """Like ``_jsonl_rows`` for a Parquet file, read in batches of 1,024 rows (never the whole table: memory holds
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


class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _parse(value: Any, prompt_key: str, label_key: str, metadata_key: Optional[str],
           tools_key: Optional[str], apply_chat_template: bool) -> tuple[Any, Any, dict, Optional[list]]:
    """(prompt, label, metadata, tools) of one row; raises _Bad(reason, detail)."""
    if not isinstance(value, dict):
        raise _Bad("wrong_type", f"row is a JSON {type(value).__name__}, expected an object")
    for key, what in ((prompt_key, "prompt"), (label_key, "label"), (metadata_key, "metadata"), (tools_key, "tools")):
        if key is not None and key not in value:
            raise _Bad("missing_key", f"missing {what} key {key!r} (row keys: {sorted(value)})")
    prompt = value[prompt_key]
    if isinstance(prompt, list):
        bad = [m for m in prompt if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                          and isinstance(m.get("content"), str))]
        if bad or not prompt:
            raise _Bad("wrong_type", f"{prompt_key!r} is a list but not of {{role: str, content: str}} messages")
        if not apply_chat_template:
            raise _Bad("wrong_type", f"{prompt_key!r} holds chat messages but data.apply_chat_template=false")
    elif not isinstance(prompt, str):
        raise _Bad("wrong_type", f"{prompt_key!r} holds a {type(prompt).__name__}; expected a string or a list "
                                 f"of chat messages")
    metadata = {} if metadata_key is None or value[metadata_key] is None else value[metadata_key]
    if not isinstance(metadata, dict):
        raise _Bad("wrong_type", f"metadata key {metadata_key!r} holds a {type(metadata).__name__}; expected an object")
    tools = None if tools_key is None else value[tools_key]
    if tools is not None and not isinstance(tools, list):
        raise _Bad("wrong_type", f"tools key {tools_key!r} holds a {type(tools).__name__}; expected a list")
    return prompt, value[label_key], metadata, tools


def _render(prompt: Any, tools: Optional[list], tokenizer, apply_chat_template: bool) -> str:
    if not apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # template errors come as jinja/ValueError/TypeError; all mean this row cannot render
        raise _Bad("template_error", f"chat template failed: {type(e).__name__}: {e}") from e


def _build(raw: Iterator[tuple[int, Any, Optional[tuple]]], tokenizer, source: str, unit: str, prompt_key: str,
           label_key: str, metadata_key: Optional[str], tools_key: Optional[str], apply_chat_template: bool,
           max_prompt_tokens: Optional[int], on_bad_line: str) -> PromptDataset:
    if on_bad_line not in ON_BAD_LINE:
        raise ValueError(f"data.on_bad_line={on_bad_line!r}; choose one of {', '.join(ON_BAD_LINE)}")
    stats = DatasetStats(source=source, max_prompt_tokens=max_prompt_tokens)
    parsed: list[tuple[_Row, str]] = []
    for row, value, problem in raw:
        stats.rows += 1
        try:
            if problem is not None:
                raise _Bad(*problem)
            prompt, label, metadata, tools = _parse(value, prompt_key, label_key, metadata_key, tools_key,
                                                    apply_chat_template)
            parsed.append((_Row(row, prompt, label, metadata, tools),
                           _render(prompt, tools, tokenizer, apply_chat_template)))
        except _Bad as bad:
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
        for (r, text), token_ids in zip(chunk, ids):
            stats.longest_prompt_tokens = max(stats.longest_prompt_tokens, len(token_ids))
            if max_prompt_tokens is not None and len(token_ids) > max_prompt_tokens:
                stats.too_long += 1
                continue
            records.append(PromptRecord(r.row, r.prompt, text, list(token_ids), r.label, r.metadata, r.tools))
    stats.kept = len(records)
    if not records:
        raise ValueError(f"no prompts left: {stats.summary()}"
                         + (f"; first problems: {stats.skipped_examples}" if stats.skipped_examples else ""))
    return PromptDataset(records, stats)


@dataclass
class ScanReport:
    """What a pre-flight scan of a prompt file found (``scan_prompt_file``)."""

    source: str
    """The file."""
    rows: int = 0
    """Rows of the slice scanned."""
    bad: list[str] = field(default_factory=list)
    """The first malformed rows, as "path, line k: what is wrong"."""
    num_bad: int = 0
    """Malformed rows among those scanned."""
    too_long: int = 0
    """Well-formed prompts longer than max_prompt_tokens (None when not tokenized)."""
    longest_prompt_tokens: int = 0
    """The longest prompt scanned, in tokens (0 when not tokenized)."""
    complete: bool = True
    """False when the scan stopped at its row or time bound before the end of the slice."""
    seconds: float = 0.0
    """How long the scan took."""
    first: Optional[tuple[Any, Any, dict]] = None
    """(prompt, label, metadata) of the first well-formed row, for the pre-flight call of the reward."""

    @property
    def usable(self) -> int:
        """Rows the run would keep among those scanned (malformed and too-long ones left out)."""
        return self.rows - self.num_bad - self.too_long


def scan_prompt_file(path: str, cfg: DataConfig, tokenizer=None, *, row_start: int = 0,
                     row_end: Optional[int] = None, max_rows: Optional[int] = None,
                     max_seconds: Optional[float] = None, examples: int = 10) -> ScanReport:
    """Read rows [row_start, row_end) of ``path`` as a run would (the same row rules and ``cfg.max_row_bytes`` as
    ``load_prompt_file``, every malformed row collected rather than the first raised) and, with a tokenizer, count
    the prompts longer than cfg.max_prompt_tokens. Stops after ``max_rows`` rows or ``max_seconds`` (``complete``
    says whether it reached the end of the slice); memory stays bounded by the row cap and the tokenizer's chunks."""
    import time

    start = time.monotonic()
    suffix = Path(path).suffix.lower()
    raw = (_jsonl_rows(path, row_start, row_end, cfg.max_row_bytes) if suffix == ".jsonl"
           else _parquet_rows(path, row_start, row_end, cfg.max_row_bytes))
    unit = "line" if suffix == ".jsonl" else "row"
    report = ScanReport(source=str(path))
    texts: list[str] = []  # rendered prompts not tokenized yet, `chars` characters in all
    chars = 0

    def encode() -> None:
        for ids in tokenizer(texts, add_special_tokens=not cfg.apply_chat_template)["input_ids"]:
            report.longest_prompt_tokens = max(report.longest_prompt_tokens, len(ids))
            report.too_long += len(ids) > cfg.max_prompt_tokens
        texts.clear()

    for row, value, problem in raw:
        if (max_rows is not None and report.rows >= max_rows) or (
                max_seconds is not None and time.monotonic() - start > max_seconds):
            report.complete = False
            break
        report.rows += 1
        try:
            if problem is not None:
                raise _Bad(*problem)
            prompt, label, metadata, tools = _parse(value, cfg.prompt_key, cfg.label_key, cfg.metadata_key,
                                                    cfg.tools_key, cfg.apply_chat_template)
            if report.first is None:
                report.first = (prompt, label, metadata)
            if tokenizer is not None:
                text = _render(prompt, tools, tokenizer, cfg.apply_chat_template)
                if texts and (len(texts) >= _ENCODE_CHUNK or chars + len(text) > _ENCODE_CHARS):
                    encode()
                    chars = 0
                texts.append(text)
                chars += len(text)
        except _Bad as bad:
            report.num_bad += 1
            if len(report.bad) < examples:
                report.bad.append(BadLineError(str(path), row + 1, bad.reason, bad.detail, unit).where_what)
    if texts:
        encode()
    report.seconds = time.monotonic() - start
    return report
