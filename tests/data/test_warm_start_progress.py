"""The SFT warm start says how far it is (issue 46 item 5: a busy machine once ran it 17 minutes without a word)."""

import re

from slime_hydra.model import warm_start
from slime_hydra.model.config import ModelConfig


def test_the_warm_start_prints_progress_between_its_first_and_last_line(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "PROGRESS_S", 0.0)  # a line after every step but the last
    lines: list[str] = []
    model = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, tokenizer="char", sft_warm_start_steps=3,
                        sft_batch_size=4)
    warm_start.build_checkpoint(model, "addition", tmp_path / "m", seed=0, log=lines.append)
    progress = [line for line in lines if "SFT warm start: step" in line]
    assert [re.search(r"step (\d+)/3", line).group(1) for line in progress] == ["1", "2"]
    assert all(re.search(r"loss \d+\.\d{3}, \d+ s \(about \d+ s to go\)", line) for line in progress), progress
    assert "SFT warm start: 3 steps x 4 examples" in lines[-1]
