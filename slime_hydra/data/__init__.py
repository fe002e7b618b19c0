"""Prompt data: datasets (JSONL / Parquet / built-in tasks) and the resumable prompt source."""

from slime_hydra.data.dataset import (BadLineError, DatasetStats, PromptDataset, PromptRecord, load_eval_prompts,
                                      load_prompt_file, load_prompt_rows, load_prompts)
from slime_hydra.data.source import PromptSource

__all__ = ["BadLineError", "DatasetStats", "PromptDataset", "PromptRecord", "PromptSource", "load_eval_prompts",
           "load_prompt_file", "load_prompt_rows", "load_prompts"]
