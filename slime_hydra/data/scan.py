"""The pre-flight scan of a prompt file: every row read as a run would read it (the row rules of ``dataset.py``),
every malformed row collected rather than the first raised (for algo=sft, a row without a response too), and the
prompts too long counted, within a row and time bound (config/datasets.py runs it before anything starts)."""

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from slime_hydra.data.config import DataConfig
from slime_hydra.data.dataset import (ENCODE_CHARS, ENCODE_CHUNK, BadLineError, RowProblem, jsonl_rows, parquet_rows,
                                      parse_response, parse_row, render_row)


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
                     max_seconds: Optional[float] = None, examples: int = 10,
                     response_keys: tuple[str, ...] = ()) -> ScanReport:
    """Read rows [row_start, row_end) of ``path`` as a run would (the same row rules and ``cfg.max_row_bytes`` as
    ``load_prompt_file``, every malformed row collected rather than the first raised) and, with a tokenizer, count
    the prompts longer than cfg.max_prompt_tokens. ``response_keys`` (algo=sft, dpo): a row without a string response
    under each is malformed too. Stops after ``max_rows`` rows or ``max_seconds`` (``complete`` says whether it reached
    the end of the slice); memory stays bounded by the row cap and the tokenizer's chunks."""
    start = time.monotonic()
    suffix = Path(path).suffix.lower()
    raw = (jsonl_rows(path, row_start, row_end, cfg.max_row_bytes) if suffix == ".jsonl"
           else parquet_rows(path, row_start, row_end, cfg.max_row_bytes))
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
                raise RowProblem(*problem)
            prompt, label, metadata, tools = parse_row(value, cfg.prompt_key, cfg.label_key, cfg.metadata_key,
                                                    cfg.tools_key, cfg.apply_chat_template)
            for key in response_keys:
                parse_response(value, key)
            if report.first is None:
                report.first = (prompt, label, metadata)
            if tokenizer is not None:
                text = render_row(prompt, tools, tokenizer, cfg.apply_chat_template)
                if texts and (len(texts) >= ENCODE_CHUNK or chars + len(text) > ENCODE_CHARS):
                    encode()
                    chars = 0
                texts.append(text)
                chars += len(text)
        except RowProblem as bad:
            report.num_bad += 1
            if len(report.bad) < examples:
                report.bad.append(BadLineError(str(path), row + 1, bad.reason, bad.detail, unit).where_what)
    if texts:
        encode()
    report.seconds = time.monotonic() - start
    return report
