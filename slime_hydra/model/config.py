"""Model group schema: the architecture facts validation needs, and where the weights live.

Every model option under ``conf/model/`` carries its real architecture numbers (from the model's HF
``config.json``), so a login node with no download can check parallelism against heads, layers and context.
``path`` is the user's HF checkpoint directory; when it is set and exists, its ``config.json`` is compared against
these numbers before anything starts (a mismatch means the wrong option was chosen).
"""

import re
from dataclasses import dataclass
from typing import Iterator, Optional

from slime_hydra.model.families import FAMILIES, Family
from slime_hydra.options import Problem, choice, non_negative, positive

CHAR_VOCAB = 101
"""Tokens of the character tokenizer (model/tiny.py)."""
BPE_MIN_VOCAB = 261
"""The smallest byte-level BPE vocabulary: 5 special tokens + 256 bytes (model/bpe.py)."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Short name used in run names and logs (the conf/model option name)."""
    family: str = choice("qwen2", FAMILIES)
    """Architecture family: qwen2 | qwen3 | qwen3_moe | llama | glm4 | glm4_moe | deepseek_v3 (its record in
    model/families.py: config.json fields, layout, the backends and engines that run it)."""
    path: Optional[str] = None
    """HF checkpoint directory (config.json, tokenizer, safetensors); null builds the tiny model offline (tiny only)."""
    num_layers: int = positive(4)
    """Transformer layers."""
    hidden_size: int = positive(128)
    """Residual stream width (d_model)."""
    num_attention_heads: int = positive(4)
    """Query heads per layer."""
    num_kv_heads: int = positive(2)
    """Key/value heads per layer (GQA); equal to num_attention_heads for MHA."""
    head_dim: Optional[int] = positive(None)
    """Per-head width; null means hidden_size / num_attention_heads (multi-latent attention: null, its query/key heads
    are qk_nope_head_dim + qk_rope_head_dim wide, its value heads v_head_dim)."""
    ffn_hidden_size: int = positive(384)
    """Dense MLP intermediate width (for MoE models: the dense layers' width)."""
    vocab_size: int = positive(128)
    """Embedding rows (the padded vocabulary of the checkpoint)."""
    max_position_embeddings: int = positive(256)
    """Context length in tokens the model was trained for (prompt + response must fit)."""
    tie_word_embeddings: bool = True
    """Output projection shares the input embedding matrix."""
    rope_theta: float = positive(10000.0)
    """RoPE base frequency."""
    num_experts: int = non_negative(0)
    """Routed experts per MoE layer; 0 for dense models."""
    moe_top_k: int = non_negative(0)
    """Experts activated per token; 0 for dense models."""
    moe_ffn_hidden_size: Optional[int] = positive(None)
    """Intermediate width of one routed expert; null for dense models."""
    moe_shared_experts: int = non_negative(0)
    """Shared experts of every MoE layer (HF n_shared_experts), each moe_ffn_hidden_size wide: every token passes
    through them besides its moe_top_k routed experts (GLM-4.5, DeepSeek-V3: 1)."""
    first_dense_layers: int = non_negative(0)
    """The first N layers keep a dense MLP of ffn_hidden_size, the rest are MoE (HF first_k_dense_replace)."""
    moe_groups: int = positive(1)
    """Expert groups of group-limited routing (HF n_group): a token picks its moe_top_k experts among the
    moe_group_top_k groups whose two best scores sum highest; 1: no groups."""
    moe_group_top_k: int = positive(1)
    """Groups each token may route to (HF topk_group); at most moe_groups."""
    moe_routed_scaling: float = positive(1.0)
    """Factor on the routed experts' renormalised weights (HF routed_scaling_factor; DeepSeek-V3: 2.5)."""

    q_lora_rank: Optional[int] = positive(None)
    """Multi-latent attention: width of the compressed query latent (HF q_lora_rank); null: queries are projected
    from the hidden state directly (and for other attention)."""
    kv_lora_rank: Optional[int] = positive(None)
    """Multi-latent attention: width of the compressed key/value latent (HF kv_lora_rank); null for other attention."""
    qk_nope_head_dim: Optional[int] = positive(None)
    """Multi-latent attention: a query/key head's channels without RoPE (HF qk_nope_head_dim)."""
    qk_rope_head_dim: Optional[int] = positive(None)
    """Multi-latent attention: a query/key head's channels with RoPE; the key's are one projection shared by every
    head (HF qk_rope_head_dim)."""
    v_head_dim: Optional[int] = positive(None)
    """Multi-latent attention: a value head's width (HF v_head_dim)."""

    tokenizer: Optional[str] = choice(None, ("char", "bpe"))
    """A model built offline when path is null (model/warm_start.py): char (one token per character, model/tiny.py)
    or bpe (byte-level BPE trained on the task's text, model/bpe.py); null: the model needs path."""
    sft_warm_start_steps: int = non_negative(0)
    """Built model only (path null): SFT steps on the task's generated answers before RL (0: none)."""
    sft_batch_size: int = positive(64)
    """Built model only: prompt + answer pairs per SFT step."""
    sft_lr: float = positive(1e-3)
    """Built model only: the SFT's AdamW learning rate (constant, no weight decay)."""

    @property
    def kv_channels(self) -> int:
        """Per-head query/key width actually used (head_dim; with multi-latent attention qk_nope_head_dim +
        qk_rope_head_dim; else hidden_size / num_attention_heads)."""
        if self.head_dim is not None:
            return self.head_dim
        if self.is_mla:
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        return self.hidden_size // self.num_attention_heads

    @property
    def spec(self) -> Family:
        """The family's record (model/families.py); a family that is not registered is a domain problem."""
        return FAMILIES[self.family]

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (the family's ``latent_attention``)."""
        return self.family in FAMILIES and self.spec.latent_attention

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def check(self, prefix: str) -> Iterator[Problem]:
        """What the field domains cannot say (options.py)."""
        if not re.fullmatch(r"[\w.+=,@-]+", self.name) or set(self.name) == {"."}:
            yield Problem((f"{prefix}name",), f"{self.name!r} is not a plain name (letters, digits and . _ - + = , @): "
                          "it names the default run directory", f"e.g. {prefix}name=qwen3_8b_sft")
        if self.path is None and self.tokenizer is None:
            yield Problem((f"{prefix}path",), f"model={self.name} needs its HF checkpoint directory",
                          f"set {prefix}path=/path/to/{self.name} (only model=tiny and model=small are built offline)")
        if self.path is None and self.tokenizer == "bpe" and self.vocab_size < BPE_MIN_VOCAB:
            yield Problem((f"{prefix}vocab_size",), f"a byte-level BPE tokenizer needs at least {BPE_MIN_VOCAB} tokens "
                          f"(5 special + 256 bytes), got {self.vocab_size}", f"set {prefix}vocab_size={BPE_MIN_VOCAB} "
                          "or more")
        if self.path is None and self.tokenizer == "char" and self.vocab_size < CHAR_VOCAB:
            yield Problem((f"{prefix}vocab_size",), f"the character tokenizer has {CHAR_VOCAB} tokens, more than "
                          f"vocab_size={self.vocab_size}", f"set {prefix}vocab_size={CHAR_VOCAB} or more")
        if self.family not in FAMILIES:  # the domain names it; the family's own rules need its record
            return
        yield from self._moe_problems(prefix)
        yield from self._mla_problems(prefix)
        if self.num_kv_heads > 0 and self.num_attention_heads % self.num_kv_heads:
            yield Problem((f"{prefix}num_attention_heads", f"{prefix}num_kv_heads"),
                          f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                          f"num_kv_heads={self.num_kv_heads}", "check the model option's numbers against its config.json")

    def _moe_problems(self, prefix: str) -> Iterator[Problem]:
        """The expert numbers agree with each other and with the family."""
        moe_keys = (f"{prefix}num_experts", f"{prefix}moe_top_k", f"{prefix}moe_ffn_hidden_size")
        moe_families = ", ".join(name for name, f in FAMILIES.items() if f.moe)
        if self.spec.moe and not self.is_moe:
            yield Problem((f"{prefix}num_experts", f"{prefix}family"), f"family={self.family} is a mixture of experts "
                          "but num_experts=0", "set num_experts, moe_top_k and moe_ffn_hidden_size from its config.json")
        elif not self.spec.moe and (self.is_moe or self.moe_top_k or self.moe_ffn_hidden_size):
            yield Problem((*moe_keys, f"{prefix}family"), f"family={self.family} is dense; the expert options "
                          f"(num_experts={self.num_experts}, moe_top_k={self.moe_top_k}, "
                          f"moe_ffn_hidden_size={self.moe_ffn_hidden_size}) describe no layer of it",
                          f"remove them, or set {prefix}family to one of {moe_families}")
        elif self.is_moe and (self.moe_top_k == 0 or self.moe_ffn_hidden_size is None):
            yield Problem(moe_keys, f"num_experts={self.num_experts} needs moe_top_k (experts per token) and "
                          f"moe_ffn_hidden_size (one expert's width); got {self.moe_top_k} and "
                          f"{self.moe_ffn_hidden_size}", "set both from the checkpoint's config.json "
                          "(num_experts_per_tok, moe_intermediate_size)")
        elif self.is_moe and self.moe_top_k > self.num_experts:
            yield Problem((f"{prefix}moe_top_k", f"{prefix}num_experts"), f"moe_top_k={self.moe_top_k} experts per "
                          f"token, of only num_experts={self.num_experts}", f"set {prefix}moe_top_k <= "
                          f"{self.num_experts}")
        yield from self._router_problems(prefix)

    def _mla_problems(self, prefix: str) -> Iterator[Problem]:
        """Multi-latent attention's widths are all set for an MLA family and none for the others."""
        names = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.is_mla:
            set_ = [n for n in names if getattr(self, n) is not None]
            if set_:
                yield Problem(tuple(f"{prefix}{n}" for n in set_) + (f"{prefix}family",),
                              f"family={self.family} has no multi-latent attention; {', '.join(set_)} describe none "
                              "of its layers", f"remove them, or set {prefix}family to one of "
                              f"{', '.join(name for name, f in FAMILIES.items() if f.latent_attention)}")
            return
        missing = [n for n in names[1:] if getattr(self, n) is None]
        if missing:
            yield Problem(tuple(f"{prefix}{n}" for n in missing), f"family={self.family} (multi-latent attention) "
                          f"needs {', '.join(missing)}", "set them from the checkpoint's config.json")
        if self.head_dim is not None:
            yield Problem((f"{prefix}head_dim",), f"family={self.family} gives its head widths as qk_nope_head_dim, "
                          f"qk_rope_head_dim and v_head_dim; head_dim={self.head_dim} would be a second answer",
                          f"set {prefix}head_dim=null")
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            yield Problem((f"{prefix}qk_rope_head_dim",), f"qk_rope_head_dim={self.qk_rope_head_dim} rotates pairs "
                          "of channels: it must be even", "check it against the checkpoint's config.json")
        if self.num_kv_heads != self.num_attention_heads:
            yield Problem((f"{prefix}num_kv_heads", f"{prefix}num_attention_heads"),
                          f"multi-latent attention expands its keys and values to every head: num_kv_heads="
                          f"{self.num_kv_heads} must equal num_attention_heads={self.num_attention_heads}",
                          f"set {prefix}num_kv_heads={self.num_attention_heads}")

    def _router_problems(self, prefix: str) -> Iterator[Problem]:
        """DeepSeek's router and layer layout (a family's ``grouped_router``): groups that split the experts evenly, enough
        experts in the chosen groups, dense first layers that leave MoE layers; other families leave the fields at
        their defaults."""
        keys = {"moe_shared_experts": 0, "first_dense_layers": 0, "moe_groups": 1, "moe_group_top_k": 1,
                "moe_routed_scaling": 1.0}
        if not self.spec.grouped_router:
            set_ = {k: getattr(self, k) for k, default in keys.items() if getattr(self, k) != default}
            if set_:
                yield Problem(tuple(f"{prefix}{k}" for k in set_) + (f"{prefix}family",),
                              f"family={self.family} has no shared experts, dense first layers or grouped router; "
                              f"{', '.join(f'{k}={v}' for k, v in set_.items())} describe no layer of it",
                              f"remove them, or set {prefix}family to one of "
                              f"{', '.join(name for name, f in FAMILIES.items() if f.grouped_router)}")
            return
        groups, chosen, experts = self.moe_groups, self.moe_group_top_k, self.num_experts
        if self.first_dense_layers >= self.num_layers:
            yield Problem((f"{prefix}first_dense_layers", f"{prefix}num_layers"),
                          f"first_dense_layers={self.first_dense_layers} of num_layers={self.num_layers} leaves no "
                          "MoE layer", "check the model option's numbers against its config.json "
                          "(first_k_dense_replace)")
        if not experts or groups < 1 or chosen < 1:  # (a value below 1 is its field's domain problem)
            return
        if experts % groups:
            yield Problem((f"{prefix}moe_groups", f"{prefix}num_experts"), f"moe_groups={groups} does not split "
                          f"num_experts={experts} evenly", "check n_group against the checkpoint's config.json")
        elif groups > 1 and experts // groups < 2:
            yield Problem((f"{prefix}moe_groups", f"{prefix}num_experts"), f"moe_groups={groups} leaves "
                          f"{experts // groups} expert per group; a group is scored by its two best experts",
                          f"choose moe_groups <= {experts // 2}")
        elif chosen > groups:
            yield Problem((f"{prefix}moe_group_top_k", f"{prefix}moe_groups"), f"moe_group_top_k={chosen} groups "
                          f"per token, of only moe_groups={groups}", f"set {prefix}moe_group_top_k <= {groups}")
        elif self.moe_top_k > chosen * (experts // groups):
            yield Problem((f"{prefix}moe_top_k", f"{prefix}moe_group_top_k"), f"moe_top_k={self.moe_top_k} experts "
                          f"per token, but the {chosen} chosen group(s) hold {chosen * (experts // groups)}",
                          "check num_experts_per_tok and topk_group against the checkpoint's config.json")
