"""Dataset files scanned before anything starts (dry runs included): every malformed row at once, and how many
prompts are too long.

For the training file and every eval file that exists here (``config/files.py`` reports missing ones), the rows
are read exactly as the run will read them (``data/scan.scan_prompt_file``). With ``data.on_bad_line=error``
(the default) malformed rows are a Problem listing them as ``path, line k: what is wrong`` (the first 10 and the
count); with ``skip`` they are a note (the run skips and counts them). Prompts longer than
``data.max_prompt_tokens`` are counted with the model's tokenizer (the tiny model's is built offline; a
``model.path`` that is not here skips the count) and noted: the run drops them. A scan reads at most ``MAX_ROWS``
rows or ``MAX_SECONDS``, and its note says what it covered.
"""

from pathlib import Path
from typing import Iterator, Optional

from slime_hydra.config.schema import SlimeConfig
from slime_hydra.options import Problem

MAX_ROWS = 200_000
"""Rows a scan reads at most."""
MAX_SECONDS = 20.0
"""Seconds a scan takes at most (checked every 1,000 rows)."""


def dataset_files(cfg: SlimeConfig) -> list[tuple[str, str, int, Optional[int]]]:
    """(config key, path, row_start, row_end) of every dataset file the run reads: the rows it reads of each."""
    d = cfg.data
    files = [("data.path", d.path, d.row_start, d.row_end)] + [
        (f"data.eval.{i}.path", e.path, 0, e.max_prompts) for i, e in enumerate(d.eval)]
    return [file for file in files if file[1] is not None]


def _tokenizer(cfg: SlimeConfig):
    """The tokenizer the run will use, when it can be had here; None otherwise."""
    if cfg.model.path is None:
        from slime_hydra.model.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    if (Path(cfg.model.path) / "tokenizer_config.json").exists() or (Path(cfg.model.path) / "tokenizer.json").exists():
        from slime_hydra.model.hf import load_tokenizer

        try:
            return load_tokenizer(cfg.model.path)
        except Exception:  # a damaged tokenizer: config/files.py names it; the scan goes on without lengths
            return None
    return None


def check_datasets(cfg: SlimeConfig, notes: Optional[list[str]] = None,
                   first_rows: Optional[dict[str, tuple]] = None) -> Iterator[Problem]:
    """Problems of the dataset files that exist here; what the run will skip or drop goes to ``notes``, and the
    first well-formed row of each file to ``first_rows`` (key -> (prompt, label, metadata))."""
    from slime_hydra.data.dataset import response_keys
    from slime_hydra.data.scan import scan_prompt_file

    present = [file for file in dataset_files(cfg) if Path(file[1]).is_file()]
    if not present:
        return
    tokenizer = _tokenizer(cfg)
    for key, path, row_start, row_end in present:
        try:
            keys = response_keys(cfg.data, 0 if cfg.algo.from_data else None, cfg.algo.pairs)  # every row's
            report = scan_prompt_file(path, cfg.data, tokenizer, row_start=row_start, row_end=row_end,
                                      max_rows=MAX_ROWS, max_seconds=MAX_SECONDS, response_keys=keys)
        except (OSError, ValueError) as error:
            yield Problem((key,), f"{path} cannot be read: {type(error).__name__}: {error}",
                          f"point {key} at a readable .jsonl or .parquet file")
            continue
        if report.first is not None and first_rows is not None:
            first_rows[key] = report.first
        sliced = f" [{row_start}, {row_end if row_end is not None else 'end'})" if row_start or row_end else ""
        covered = (f"all {report.rows} rows{sliced}" if report.complete
                   else f"the first {report.rows} rows{sliced} (a bounded scan: {report.seconds:.0f} s)")
        if report.complete and not report.rows:
            yield Problem((key, *(("data.row_start", "data.row_end") if sliced and key == "data.path" else ())),
                          f"{path} has no rows{' in' + sliced if sliced else ''}: the run would have no prompts",
                          f"point {key} at a file with prompts" + (", or widen data.row_start / data.row_end"
                                                                    if sliced and key == "data.path" else ""))
            continue
        if report.complete and report.num_bad == report.rows and cfg.data.on_bad_line == "skip":
            yield Problem((key, "data.on_bad_line"),
                          f"every one of the {report.rows} rows{sliced} of {path} is malformed: the run would skip "
                          f"them all, e.g. {report.bad[0]}", f"fix the rows, or point {key} at another file")
            continue
        speed = f"{report.rows / max(report.seconds, 1e-9):,.0f} rows/s"
        if report.num_bad and cfg.data.on_bad_line == "error":
            listed = "\n      ".join(report.bad)
            yield Problem((key, "data.on_bad_line"),
                          f"{path}: {report.num_bad} malformed row(s) in {covered}:\n      {listed}"
                          + ("\n      ..." if report.num_bad > len(report.bad) else ""),
                          "fix them, or set data.on_bad_line=skip (the run skips and counts them)")
        elif report.num_bad and notes is not None:
            notes.append(f"{key}: {report.num_bad} malformed row(s) in {covered} will be skipped "
                         f"(data.on_bad_line=skip), e.g. {report.bad[0]}")
        if tokenizer is not None and notes is not None:
            note = (f"{key}: {path}: scanned {covered} ({speed}); longest prompt {report.longest_prompt_tokens} "
                    f"tokens")
            if report.too_long:
                note += (f"; {report.too_long} prompt(s) longer than data.max_prompt_tokens="
                         f"{cfg.data.max_prompt_tokens} will be dropped (raise it to keep them)")
            notes.append(note)
        elif notes is not None:
            notes.append(f"{key}: {path}: scanned {covered} ({speed}); prompt lengths not counted (the tokenizer "
                         f"at model.path is not here)")
        if tokenizer is not None and report.rows > report.num_bad and not report.usable:
            yield Problem((key, "data.max_prompt_tokens"),
                          f"every prompt of {path} in {covered} is longer than data.max_prompt_tokens="
                          f"{cfg.data.max_prompt_tokens} (longest {report.longest_prompt_tokens}): none would be left",
                          f"raise data.max_prompt_tokens to at least {report.longest_prompt_tokens}")
