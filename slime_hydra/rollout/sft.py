"""algo.objective=sft, dpo: a step's batch is the data's next rows with their responses, no engine involved.

    batch = sft_batch(source.take(batch_prompts), step)    # RolloutManager.generate_batch, in place of sampling

Each record (data/dataset.py, loaded with its response: ``load_prompts(..., max_response_tokens)``) becomes one
sample: the rendered prompt's tokens then the response's (EOS last), every response token trained (loss_mask 1),
reward 0, complete, weight version ``step`` (the policy that trains on it: nothing of it was sampled). The prompt
source's cursor is the manager's, checkpointed with it, so a resumed run trains on the rows the uninterrupted one
would have. algo=dpo: each record becomes two samples of one group, its chosen response (reward 1) then its rejected
one (reward 0), which train/prepare.dpo_weights reads as the pair.
"""

import statistics

from slime_hydra.buffer.sample import Sample, Status
from slime_hydra.data.dataset import PromptRecord


def sft_batch(records: list[PromptRecord], step: int) -> dict:
    """{"samples": [dict], "metrics": {...}} as ``generate_batch`` returns them: ``rollout/tokens`` (response
    tokens of the batch) and the response lengths' mean and max, in tokens."""
    samples = []
    for i, r in enumerate(records):
        if r.response_ids is None:
            raise ValueError(f"row {r.row} was loaded without a response (load_prompts needs max_response_tokens)")
        pair = [(r.response_ids, 1.0), (r.rejected_ids, 0.0)] if r.rejected_ids is not None else [(r.response_ids, 0.0)]
        for response, reward in pair:
            n = len(response)
            samples.append(Sample(index=len(samples), group_index=i, prompt=r.prompt, label=r.label,
                                  metadata=dict(r.metadata), tokens=r.token_ids + response, response_length=n,
                                  loss_mask=[1] * n, reward=reward, weight_version=step, status=Status.COMPLETED))
    lengths = [s.response_length for s in samples]
    metrics = {"rollout/tokens": float(sum(lengths)), "rollout/response_len/mean": statistics.fmean(lengths),
               "rollout/response_len/max": float(max(lengths))}
    return {"samples": [s.to_dict() for s in samples], "metrics": metrics}
