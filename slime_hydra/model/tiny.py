"""The tiny model's character tokenizer, built offline with the ``tokenizers`` library (no hub access needed).

Every printable ASCII character (space through ``~``) and the newline is one token, so a prompt like ``"12+34="``
is 6 tokens and decoding is exact. Special tokens come first (ids 0..4)::

    0 <|pad|>   1 <|endoftext|> (eos)   2 <|im_start|>   3 <|im_end|>   4 <|unk|> (any other character)

101 tokens in all, under the tiny model's 128 embedding rows (conf/model/tiny.yaml: vocab_size 128). The chat
template is ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, tool specs (when given) as JSON in
a leading system message, and ``<|im_start|>assistant\\n`` as the generation prompt.
"""

from typing import Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from slime_hydra.model.hf import save_tokenizer

PAD, EOS, IM_START, IM_END, UNK = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, IM_START, IM_END, UNK)
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n# Tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_tiny_tokenizer(save_dir: Optional[str] = None) -> PreTrainedTokenizerFast:
    """The character tokenizer described in the module docstring (101 tokens: 5 special + 96 characters).

    save_dir: when given, the tokenizer is also written there with ``save_pretrained`` (tokenizer.json,
    tokenizer_config.json with the chat template), so ``model.hf.load_tokenizer(save_dir)`` loads the same
    tokenizer; the directory is created if missing.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Each character is its own pre-token; special tokens are matched whole before this split runs.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END], padding_side="right", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        save_tokenizer(tokenizer, save_dir)
    return tokenizer
