"""train=megatron: megatron-core GPTModel built from an HF checkpoint's architecture, trained with tensor, context,
pipeline, expert (MoE) and data parallelism on torch.distributed (nccl on GPU, gloo on CPU); the policy and PPO's critic.

    model.py    Arch (the architecture facts of an HF config.json) -> TransformerConfig -> GPTModel
    spec.py     the transformer layer spec: torch SDPA core attention (no TransformerEngine or apex needed),
                HF-exact RoPE, GLM-4's sandwich norms, MoE layers, the critic's value head
    moe.py      megatron's MoE layer on TP-replicated tokens: the router's gating (and the grouped router's bias
                buffers) on any device, token movement over TP and EP (allgather dispatcher with device-agnostic
                collectives), equal shapes over EP, shared experts
    mla.py      DeepSeek-V3's multi-latent attention on megatron's MLASelfAttention: transformers' RoPE (yarn
                included), the latent norms' eps, the shared RoPE key's gradient over TP
    convert.py  HF <-> Megatron weights, incl. TP sharding (QKV per query group, gate/up halves, vocab rows, MLA's
                column-parallel projections and their RoPE rows),
                PP stages (global layer numbers; export broadcasts over the PP group) and MoE experts (global
                expert numbers; a rank loads its own, export broadcasts over the EP group)
    vocab_parallel.py  logprobs and entropy over a vocabulary split across TP ranks (no logits gather)
    context_parallel.py  megatron's load-balanced sequence split over CP ranks, the K/V and output gathers
    pipeline.py  the 1F1B pipeline schedule over torch.distributed send/recv (pp > 1), the last stage's broadcast
    gradients.py  gradient reduction over TP, the tied embedding and DP x CP; the global grad norm and clipping
    lora.py     LoRA adapters on the fused, TP-split linears (PEFT's function per HF module), merged weights
    checkpoint.py  resumable checkpoints: one file per (PP stage, TP rank[, EP rank]), every rank's RNG
    backend.py  MegatronBackend: the backend protocol of train/fsdp.py on this model (construction, stage forward
                and heads, logprobs, train_step, weights; save/load through checkpoint.py)
"""
