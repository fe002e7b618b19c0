"""The trainer's view of samples: padded, response-aligned tensors, micro-batches, and per-token logprobs.

Layout of a batch of B samples (sample i has prompt length P_i and response length R_i):

    input_ids      [B, L]  prompt + response tokens, right-padded with pad_id (L = max_i P_i + R_i)
    attention_mask [B, L]  1 on real tokens
    response_start [B]     P_i: index of the first response token in input_ids
    loss_mask      [B, T]  T = max_i R_i; the sample's loss mask over its response tokens, 0 on padding
    extras         name -> [B, T] or [B] tensors the loss reads (advantages, old/ref/rollout logprobs, ...)
    routed_experts [B, L, num_layers, top_k] int16 or None: MoE routing replay (algo.routing_replay), the experts
                   the engine chose for the token at each position and layer; -1 (NO_EXPERT): the trainer routes it

Token j of the response (input_ids[i, P_i + j]) is predicted by the logits at position P_i + j - 1, so every
response-aligned tensor has column j <-> response token j. Engines report rollout logprobs in the same layout.
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from slime_hydra.model.invariant import scaled_log_softmax
from slime_hydra.routed_experts import NO_EXPERT


@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start: torch.Tensor
    loss_mask: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    routed_experts: Optional[torch.Tensor] = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] response tokens per sample (columns of loss_mask in use)."""
        return self.attention_mask.sum(-1) - self.response_start

    def select(self, index: Sequence[int]) -> "TrainBatch":
        """The sub-batch of these rows, trimmed to its own longest sequence and response."""
        idx = torch.as_tensor(list(index), dtype=torch.long)
        sub_len = int(self.attention_mask[idx].sum(-1).max())
        sub_resp = int((self.attention_mask[idx].sum(-1) - self.response_start[idx]).max())
        extras = {k: (v[idx, :sub_resp] if v.dim() == 2 else v[idx]) for k, v in self.extras.items()}
        routed = None if self.routed_experts is None else self.routed_experts[idx, :sub_len]
        return TrainBatch(self.input_ids[idx, :sub_len], self.attention_mask[idx, :sub_len],
                          self.response_start[idx], self.loss_mask[idx, :sub_resp], extras, routed)

    def to(self, device: torch.device | str) -> "TrainBatch":
        """This batch on ``device``; host-to-GPU copies are queued without waiting for the GPU (see to_device)."""
        return TrainBatch(to_device(self.input_ids, device), to_device(self.attention_mask, device),
                          to_device(self.response_start, device), to_device(self.loss_mask, device),
                          {k: to_device(v, device) for k, v in self.extras.items()},
                          None if self.routed_experts is None else to_device(self.routed_experts, device))


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``. A host tensor bound for a GPU goes through pinned memory (torch's caching host
    allocator) as a non-blocking copy: a plain ``.to("cuda")`` from pageable memory synchronizes the stream, so a
    micro-batch loop would wait for the GPU to drain before queueing each micro-batch's kernels."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def collate(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int], loss_masks: Sequence[Sequence[int]],
            pad_id: int, extras: dict[str, Sequence] | None = None,
            routed_experts: Optional[Sequence[np.ndarray]] = None) -> TrainBatch:
    """Pad samples (tokens = prompt + response ids) into a TrainBatch.

    extras values are per-sample lists over response tokens (padded with 0 to [B, T]) or per-sample scalars ([B]).
    routed_experts: per sample, [n, num_layers, top_k] experts of its first n <= len(tokens) positions (padded with
    NO_EXPERT to [B, L, num_layers, top_k]).
    """
    lengths = [len(t) for t in tokens]
    if any(r <= 0 or r > n for r, n in zip(response_lengths, lengths)):
        raise ValueError("every sample needs 1 <= response_length <= len(tokens)")
    b, max_len, max_resp = len(tokens), max(lengths), max(response_lengths)
    input_ids = torch.full((b, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, max_len), dtype=torch.long)
    loss_mask = torch.zeros((b, max_resp), dtype=torch.float32)
    for i, (seq, r, m) in enumerate(zip(tokens, response_lengths, loss_masks)):
        if len(m) != r:
            raise ValueError(f"sample {i}: loss_mask has {len(m)} entries for {r} response tokens")
        input_ids[i, : len(seq)] = torch.as_tensor(seq)
        attention_mask[i, : len(seq)] = 1
        loss_mask[i, :r] = torch.as_tensor(m, dtype=torch.float32)
    response_start = torch.as_tensor([n - r for n, r in zip(lengths, response_lengths)], dtype=torch.long)
    padded = {}
    for name, values in (extras or {}).items():
        if isinstance(values[0], (int, float)):
            padded[name] = torch.as_tensor(values, dtype=torch.float32)
        else:
            out = torch.zeros((b, max_resp), dtype=torch.float32)
            for i, row in enumerate(values):
                out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
            padded[name] = out
    routed = None
    if routed_experts is not None:
        routed = torch.full((b, max_len, *routed_experts[0].shape[1:]), NO_EXPERT, dtype=torch.int16)
        for i, (seq, experts) in enumerate(zip(tokens, routed_experts)):
            if len(experts) > len(seq):
                raise ValueError(f"sample {i}: routed experts for {len(experts)} positions of a {len(seq)}-token "
                                 "sequence")
            routed[i, :len(experts)] = torch.from_numpy(np.ascontiguousarray(experts))
    return TrainBatch(input_ids, attention_mask, response_start, loss_mask, padded, routed)


def dp_shares(batch: TrainBatch, dp_size: int) -> list[list[int]]:
    """Rows of each data-parallel rank: every rank gets the same number of rows (FSDP's collectives run once per
    micro-batch on every rank) and about the same number of tokens. Rows, longest first, go one by one to the rank
    with the fewest tokens among those with room left (greedy; ties to the lower rank and row, so every rank computes
    the same split). With B not divisible by dp_size the first B % dp_size ranks get one row more. Written here: a
    dozen lines over our batch layout; none of our libraries partitions rows by length."""
    lengths = batch.attention_mask.sum(-1).tolist()
    rows = sorted(range(batch.size), key=lambda i: (-lengths[i], i))
    room = [batch.size // dp_size + (r < batch.size % dp_size) for r in range(dp_size)]
    shares, tokens = [[] for _ in range(dp_size)], [0] * dp_size
    for i in rows:
        rank = min((r for r in range(dp_size) if len(shares[r]) < room[r]), key=lambda r: (tokens[r], r))
        shares[rank].append(i)
        tokens[rank] += lengths[i]
    return [sorted(share) for share in shares]


def micro_batches(batch: TrainBatch, micro_batch_samples: int, max_tokens: int | None = None,
                  packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch.

    Fixed size: consecutive rows, micro_batch_samples each. Token budget (max_tokens set): rows sorted by length
    (longest first) are packed greedily while rows x longest-row <= max_tokens, so each padded micro-batch costs at
    most max_tokens positions; a single row longer than the budget gets a micro-batch of its own. ``packed``
    micro-batches (train.pack_sequences) have no padding: the budget counts real tokens (packed_micro_batches).
    """
    if max_tokens is None:
        return [list(range(s, min(s + micro_batch_samples, batch.size)))
                for s in range(0, batch.size, micro_batch_samples)]
    lengths = batch.attention_mask.sum(-1).tolist()
    if packed:
        return packed_micro_batches(lengths, max_tokens)
    order = sorted(range(batch.size), key=lambda i: -lengths[i])
    groups, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    return groups + [current]


def packed_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row groups of at most ``max_tokens`` tokens in all (a row longer than that alone), balanced by tokens: rows,
    longest first, go to the group with the fewest tokens among those with room, a new group when none has;
    ceil(total / max_tokens) groups to start with. Ties to the lower group and row (deterministic on every rank)."""
    groups: list[list[int]] = [[] for _ in range(max(-(-sum(lengths) // max_tokens), 1))]
    tokens = [0] * len(groups)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [g for g in range(len(groups)) if tokens[g] + lengths[i] <= max_tokens or not groups[g]]
        if not fits:
            groups.append([])
            tokens.append(0)
            fits = [len(groups) - 1]
        g = min(fits, key=lambda g: (tokens[g], g))
        groups[g].append(i)
        tokens[g] += lengths[i]
    return [sorted(g) for g in groups if g]


def split_to_count(groups: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """``groups`` split until there are ``count`` of them (a rank with fewer micro-batches than its data-parallel
    peers: FSDP gathers the parameters once per forward on every rank together, so every rank runs the same number).
    The group with the most tokens among those of two rows or more splits in two, its rows longest first each to
    the half with fewer tokens; when every group is a single row, empty groups ([]) make up the rest (the caller runs
    them with zero weight)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            return groups + [[] for _ in range(count - len(groups))]
        g = max(splittable, key=lambda g: (sum(lengths[i] for i in groups[g]), -g))
        halves, tokens = [[], []], [0, 0]
        for i in sorted(groups[g], key=lambda i: (-lengths[i], i)):
            h = 0 if tokens[0] <= tokens[1] else 1
            halves[h].append(i)
            tokens[h] += lengths[i]
        groups[g:g + 1] = [sorted(h) for h in halves]
    return groups


class BatchLogprobs:
    """[B, T] logprobs (and entropy) of a whole batch, or a critic's values, filled micro-batch by micro-batch on
    the device and copied to the host once: no device sync inside the micro-batch loop.

        out = BatchLogprobs(batch, device, with_entropy)
        for rows in micro_batches(...): out.put(rows, logp, entropy)   # the micro-batch's [b, t] outputs
        logp, entropy = out.host()                                     # [B, T] on the host; entropy None without
    """

    def __init__(self, batch: TrainBatch, device: torch.device, with_entropy: bool):
        self.device, self.with_entropy = device, with_entropy
        self.logp = torch.zeros(batch.loss_mask.shape, device=device)
        self.entropy = torch.zeros(batch.loss_mask.shape, device=device) if with_entropy else None

    def put(self, rows: Sequence[int], logp: torch.Tensor, entropy: torch.Tensor | None) -> None:
        """A micro-batch's outputs into its ``rows`` of the batch (fp32; columns past its longest response stay 0)."""
        index = to_device(torch.tensor(rows), self.device)
        self.logp[index, : logp.shape[1]] = logp.float()
        if self.with_entropy:
            self.entropy[index, : entropy.shape[1]] = entropy.float()

    def host(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.logp.cpu(), (self.entropy.cpu() if self.with_entropy else None)

def response_logprobs(logits: torch.Tensor, batch: TrainBatch, temperature: float = 1.0,
                      with_entropy: bool = False, first_position: int = 0,
                      invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs (and entropy) of the response tokens, [B, T], 0 where loss_mask-padding.

    logp[i, j] = z[i, p, y] - logsumexp_v z[i, p, v],  z = logits / temperature, p = P_i + j - 1, y = input_ids[i, p + 1]
    entropy[i, j] = logsumexp_v z[i, p, v] - sum_v softmax(z[i, p])_v z[i, p, v]  (= -sum_v p_v log p_v)
    logits[:, k] are the outputs at position first_position + k (a forward with logits_to_keep drops the leading
    prompt positions; first_position <= min_i P_i - 1). The per-position terms are [B, K] reductions over V that are
    gathered afterwards, so no B x T x V tensor is gathered, and the backward is a dense softmax, not a scatter.
    invariant: the engine's formula (``position_logprobs``).
    """
    k = logits.shape[1]
    pos, valid = predicting_positions(batch, first_position + k)
    ids = batch.input_ids[:, first_position + 1 : first_position + 1 + k]
    following = torch.nn.functional.pad(ids, (0, k - ids.shape[1]))  # the token each kept position predicts
    per_position, per_position_entropy = position_logprobs(logits, following, temperature, with_entropy, invariant)
    col = pos - first_position
    logp = torch.gather(per_position, 1, col) * valid
    entropy = torch.gather(per_position_entropy, 1, col) * valid if with_entropy else None
    return logp, entropy


def position_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                      invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per position of logits [..., V]: the logprob of targets [...] and the entropy (None without), fp32:
    z[y] - logsumexp(z) and logsumexp(z) - sum_v softmax(z)_v z_v, z = logits / temperature. ``invariant``
    (algo.true_on_policy): the logprob is ``log_softmax(z)[y]`` as the engine computes it
    (model/invariant.scaled_log_softmax), which rounds otherwise; it keeps a [..., V] fp32 tensor for the backward.

    Under torch.compile z[y] is read as sum_v [v = y] z_v, which is exactly z[y]: inductor computes it in the
    logsumexp's pass over V, and its backward is pointwise, fused into the softmax's. A gather's backward scatters
    into a dense zero [..., V] fp32 tensor that the softmax backward then reads. On one H200, forward and backward of
    8 x 769 positions of a 152k vocabulary took 3.78 ms with the gather, 2.60 ms so (median of 10). Eager keeps the
    gather, which makes no [..., V] temporaries."""
    if invariant:
        z = scaled_log_softmax(logits, temperature)
        logp = torch.gather(z, -1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(z.exp() * z).sum(-1) if with_entropy else None
        return logp, entropy
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    if torch.compiler.is_compiling():
        vocab = torch.arange(z.shape[-1], device=z.device, dtype=torch.int32)  # int64 compares cost 5% more
        picked = torch.where(vocab == targets.int().unsqueeze(-1), z, 0.0).sum(-1)
    else:
        picked = torch.gather(z, -1, targets.unsqueeze(-1)).squeeze(-1)
    logp = picked - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    return logp, entropy


def first_predicting_position(batch: TrainBatch) -> int:
    """The first position whose output predicts a response token (min_i P_i - 1): logits before it are unused."""
    return max(int(batch.response_start.min()) - 1, 0)


def response_values(values: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """[B, T] critic values V(s_j) of the state before response token j: values[i, P_i + j - 1, 0]; 0 on padding."""
    pos, valid = predicting_positions(batch, values.shape[1])
    return torch.gather(values[..., 0].float(), 1, pos) * valid


def predicting_positions(batch: TrainBatch, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] positions P_i + j - 1 whose outputs predict response token j, and [B, T] validity (j < R_i)."""
    cols = torch.arange(batch.loss_mask.shape[1], device=batch.input_ids.device)
    pos = (batch.response_start.unsqueeze(1) - 1 + cols).clamp(max=seq_len - 1)
    return pos, cols.unsqueeze(0) < batch.response_lengths.unsqueeze(1)


def loss_units(loss_mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """What a loss aggregation averages over: masked tokens (token_mean) or sequences (the seq_mean_* modes).

    A micro-batch's mean loss times units(micro) / units(global batch) sums to the global-batch mean, which is how
    gradient accumulation and data parallelism stay exact (see FSDPBackend.train_step).
    """
    if loss_agg == "token_mean":
        return loss_mask.sum()
    return torch.tensor(float(loss_mask.shape[0]), device=loss_mask.device)
