"""The embedded engine: a transformers causal LM behind the subset of SGLang's native HTTP protocol slime_hydra uses.

Run ``python -m slime_hydra.rollout.engines.embedded --model-path DIR --port P [--device cpu|cuda] [--dtype ...]
[--max-batch-size N]``. ``DIR`` is a local HF checkpoint directory; its tokenizer is loaded when the directory has
one (then ``text`` prompts, ``stop`` strings and response ``text`` work; without one, send ``input_ids``). The server
binds 127.0.0.1 unless ``--host`` says otherwise. The rollout code talks to this server and to real SGLang servers
the same way, through sglang-router, so field names and response shapes follow SGLang's.

With ``SLIME_HYDRA_API_KEY`` in its environment (the run's key, rollout/auth.py) every endpoint but ``/health`` and
``/health_generate`` answers 401 to a request without ``Authorization: Bearer <key>`` and does nothing, as SGLang does
with ``--api-key``; without a key everything is open and a host other than loopback is refused.

Endpoints
---------
``GET /health`` (200 once the model is loaded), ``GET /health_generate`` (runs a one-token generation),
``GET /model_info`` | ``/get_model_info``, ``GET /server_info`` | ``/get_server_info``, ``GET /get_load``,
``GET /get_weight_version``, ``POST /generate``, ``POST /abort_request``, ``GET|POST /flush_cache``,
``POST /pause_generation``, ``POST /continue_generation``, ``POST /update_weights_from_disk``,
``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
``POST /destroy_weights_update_group``, ``POST /update_weights_from_tensor``, ``POST /update_weight_version``,
``POST /load_lora_adapter``, ``POST /unload_lora_adapter``, ``POST /release_memory_occupation``,
``POST /resume_memory_occupation``.

/generate
---------
One prompt (``input_ids: [int]`` or ``text: str``) or a batch (``input_ids: [[int]]`` or ``text: [str]``, answered
with a list in the same order). ``sampling_params`` (a dict, or one dict per prompt): ``temperature`` (default 1.0;
below 1e-6 means greedy), ``top_p``, ``top_k`` (-1 disables), ``min_p``, ``max_new_tokens`` (default 128; 0 only
scores the prompt), ``stop`` (strings; need a tokenizer), ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``
(a per-request generator: the same seed gives the same tokens whatever else shares the batch),
``skip_special_tokens``, ``no_stop_trim``. SGLang parameters this engine does not implement (penalties,
``min_new_tokens``, ``n`` > 1, constrained decoding, ``logit_bias``) are refused with 400 unless at their neutral
value; unknown keys are refused too. Top level: ``rid`` (default: a fresh uuid), ``return_logprob``,
``logprob_start_len`` (-1, the default, returns no prompt logprobs), ``top_logprobs_num``,
``return_text_in_logprobs``, ``return_routed_experts`` (MoE models; needs ``--enable-return-routed-experts``, with
which it defaults to true: sglang-router 0.3.2 drops the field, so the flag alone asks for them). The fields
sglang-router adds to every request it forwards are accepted.

Each response is ``{"text", "output_ids", "meta_info"}``; ``meta_info`` has ``id``, ``finish_reason``
(``{"type": "length", "length": n}``, ``{"type": "stop", "matched": token_id | "string"}`` or
``{"type": "abort", "message": ...}``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (always 0: no
prefix cache), ``weight_version`` and ``e2e_latency``; with ``return_logprob``: ``output_token_logprobs`` as
``[[logprob, token_id, None], ...]`` (the third item is the token's text with ``return_text_in_logprobs``),
``input_token_logprobs`` (from ``logprob_start_len``; the first prompt token's logprob is None), and with
``top_logprobs_num`` also ``output_top_logprobs`` / ``input_top_logprobs``; with routed experts,
``routed_experts``: the experts each layer's router chose for every position run (prompt + response - 1; base64
int32 [positions, layers, top_k], -1 on dense layers; slime_hydra/routed_experts.py), recorded by ``routing``.

**Logprobs** are ``log_softmax(logits / temperature)`` at the token: the temperature-scaled distribution, before
top-p / top-k / min-p truncation (what slime's trainer recomputes as ``logits / rollout_temperature``). Greedy
requests (temperature 0) report the raw distribution (temperature 1). The output ids include the token that matched
a stop/EOS condition, with its logprob. Finish checks follow SGLang's order: ``max_new_tokens`` first, then (unless
``ignore_eos``, which disables both) EOS ids and ``stop_token_ids``, then stop strings, then the context length.
EOS ids are the union of ``config.json``, ``generation_config.json`` and the tokenizer's.

Batching
--------
A scheduler coroutine owns the running batch and calls the model from one worker thread, one hand-off per iteration:
either the prefill of newly admitted requests (FIFO, up to ``--max-batch-size`` rows) or decode steps of the running
batch until one finishes a request or anything waits for a step boundary (a new request, an abort, a pause, a weight
update), so new requests join at the next step boundary and finished ones leave at once. Each running request owns a
slot of a preallocated KV cache, written in place (``slots.py``: layout, attention, memory). On CUDA the decode step
is replayed from CUDA graphs, one per batch-size bucket and attention window, captured on first use, and so are
short prefills (``graphs.py``; ``--disable-cuda-graph`` runs both eagerly), its decoder layers torch.compiled with
eager bf16 numerics (``--torch-compile``, on by default on CUDA for dense models), and each decode step is launched
before the host takes in the previous one's tokens (``ModelRunner._decode``: the host's bookkeeping overlaps the
device's step). The query/key/value projections of an attention block, and the gate/up projections of an MLP, run
as one matmul over stacked weights (``stacking.py``). On one H200 a Qwen2.5-0.5B-shaped model at 256 concurrent
requests decodes a step in 2.3 ms in-process (110k tokens/s) and serves 96k generated tokens/s over HTTP (median of
7 rounds; docs/benchmarks.md splits a decode step by kernel and an HTTP round by the ``step_times`` counters of
``server_info``). Under greedy decoding a request's tokens match running it alone (same numbers up to float
summation order, checked against ``model.generate`` in the tests).

Aborts, pausing, weight versions
--------------------------------
``/abort_request {"rid"}`` (or ``{"abort_all": true}``) ends a waiting or running request at the next step boundary
with ``finish_reason.type == "abort"`` and the tokens generated so far; a client that disconnects aborts its request.
``/pause_generation {"mode"}``: ``abort`` (default: abort everything, then hold new requests), ``in_place`` (running
requests keep their KV cache and stop stepping) or ``retract`` (running requests drop their KV cache and go back to
the queue with their tokens; continuing re-prefills prompt + tokens so far). ``/continue_generation`` resumes.

``weight_version`` is a string, as in SGLang (``--weight-version``, default "0"). Every update request may set it
(``weight_version``); ``/update_weights_from_disk`` without one bumps an integer version by one (a disk reload is a
whole new policy), while tensor and distributed updates without one leave it alone (they may be one bucket of many,
as in SGLang). An update waits until the running batch drains (new requests are held meanwhile) unless generation is
paused in place, in which case it applies at once and the paused requests continue on the new weights; with
``abort_all_requests`` it aborts them first. ``meta_info.weight_version`` is the version when the response was made.

Weight transport: ``/update_weights_from_tensor`` takes ``serialized_named_tensors: [base64 safetensors]``, or with
``load_format: "cuda_ipc"`` a JSON list of CUDA IPC handles to the trainer's buffers on the same GPU (see
``slime_hydra/weight_transport.py``; no pickle either way). ``/update_weights_from_distributed`` receives
``names``/``dtypes``/``shapes`` broadcast from rank 0 of the group made by ``/init_weights_update_group``
(``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``: gloo on CPU, nccl
on GPU). Tensors may be any subset of
the model's state dict (buckets); ``/update_weights_from_disk {"model_path"}`` must cover every weight.

``/update_weight_version {"new_version", "abort_all_requests"}`` relabels the weights (SGLang's; it aborts every
request unless ``abort_all_requests`` is false).

LoRA adapters
-------------
With ``--lora-config JSON`` (a PEFT adapter config) the model is served with LoRA adapter modules, fp32, B = 0 at
start, applied at run time: each adapted linear computes ``W x + (lora_alpha / r) B A x``. Two ways set them:

- **in place** (the model's own adapter): weight updates by saved-adapter keys (``weight_transport.adapter_key``)
  write A and B like any weight; requests without ``lora_path`` run with it.
- **named** (SGLang's LoRA protocol): ``/load_lora_adapter {"lora_name", "lora_path"}`` reads a PEFT adapter
  directory (same ``r``, ``lora_alpha`` and ``target_modules`` as ``--lora-config``, plain LoRA), and a /generate with
  ``lora_path: name`` (one name, or one per prompt of a batch) runs with it; an unknown name is refused (400).
  ``/unload_lora_adapter {"lora_name"}`` refuses the name to new requests at once and drops the adapter once the
  requests using it have ended. Both answer ``{"success", "error_message", "loaded_adapters": {name: path}}``.

A running batch runs with one adapter: the scheduler admits only requests with the batch's ``lora_path`` and, once the
batch is empty, copies the next request's adapter into the modules (in place: the decode graphs stay valid). Mixed
queues are served in turns, FIFO.

``/release_memory_occupation`` (needs an empty running batch: pause with ``abort`` or ``retract`` first) gives the
device memory of its tags back (memory.py): ``weights`` (their bytes first go to a pinned host copy, kept from one
release to the next) and ``kv_cache`` (its contents dropped); on CUDA their pages are unmapped and their addresses
kept, so the CUDA graphs, the compiled steps and the cache's capacity survive and nothing is captured again (on the
CPU only the state changes). ``cuda_graph`` gives nothing back: the graphs stay. While the weights are released,
requests wait in the queue and weight updates write into the host copy; ``/resume_memory_occupation`` maps the
memory again and copies the weights back. A cache released alone (the colocated loop resumes the weights first, for
the weight sync) is taken back by the next step that needs it.

Modules
-------
Data flows one way: ``server`` -> ``scheduler`` -> ``runner`` -> ``sampling`` (and ``slots``, ``graphs``,
``weights`` -> ``stacking``, ``memory``); ``protocol`` is used by all of them and uses none.

- ``protocol``: the request side of the protocol: ``SamplingParams``, ``Request``, ``RequestError``, a /generate body
  -> Requests, a finished Request -> its response dict.
- ``sampling``: next tokens and their logprobs from logits (temperature, top-k / top-p / min-p, seeded draws).
- ``slots``: the slot KV cache and the attention that uses it.
- ``graphs``: decode and prefill steps as CUDA graphs, and the decoder layers compiled for decode.
- ``stacking``: sibling projections (q/k/v, gate/up) as one matmul over stacked weights that keep the model's names.
- ``routing``: hooks on a MoE model's routers that record the experts of every token run (also under CUDA graphs).
- ``weights``: the model's weights by name: placement, updates, named LoRA adapters, weight-update groups.
- ``memory``: the releasable device memory (weights, KV cache) at stable addresses, on torch_memory_saver.
- ``runner``: ``ModelRunner``, the model and all work on the model thread (prefill, decode, memory, its weights).
- ``scheduler``: ``Engine``, the queues and the coroutine that hands the runner a prefill, a run of decode steps or a
  control operation at a time; with ``freeze_heap`` (the command line) it keeps the garbage collector off the
  engine's long-lived objects (slime_hydra/heap.py).
- ``server``: the aiohttp routes (``build_app``) and ``read_checkpoint``.
- ``__main__``: the command line.
"""

PREFILL_GRAPH_TOKENS = 4096
"""The largest prefill (row bucket x padded width, in tokens) that runs as a CUDA graph (graphs.py); the memory plan
counts its activations (config/memory.py)."""

MIN_CAPACITY = 128
"""The slot cache's smallest capacity and attention window, in tokens (slots.py)."""


def cache_capacity(length: int, limit: int) -> int:
    """Columns of slot cache (or attention window) that hold ``length`` tokens: the next power of two, at least
    ``MIN_CAPACITY``, at most ``limit`` (the context length, or the capacity). The memory plan counts the cache with
    the same rule (config/memory.py)."""
    return min(max(MIN_CAPACITY, 1 << (length - 1).bit_length()), limit)
