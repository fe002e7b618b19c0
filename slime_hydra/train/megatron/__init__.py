"""train=megatron: megatron-core GPTModel built from an HF checkpoint's architecture, trained with tensor and data
parallelism on torch.distributed (nccl on GPU, gloo on CPU).

    model.py    Arch (the architecture facts of an HF config.json) -> TransformerConfig -> GPTModel
    spec.py     the transformer layer spec: torch SDPA core attention (no TransformerEngine or apex needed),
                HF-exact RoPE, GLM-4's sandwich norms
    convert.py  HF <-> Megatron weights, incl. TP sharding (QKV per query group, gate/up halves, vocab rows)
    vocab_parallel.py  logprobs and entropy over a vocabulary split across TP ranks (no logits gather)
    backend.py  MegatronBackend: the backend protocol of train/fsdp.py on this model
"""
