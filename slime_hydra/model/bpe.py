"""A byte-level BPE tokenizer trained on the task's own text, for a model built offline (``model.tokenizer=bpe``).

    tokenizer = build_bpe_tokenizer(texts, vocab_size)       # texts: the prompts and answers the model will see

The ``tokenizers`` library learns the merges (BPE on bytes, so every string encodes and decodes exactly); what is
ours is only the setup, which the library cannot choose for us:

- digits are split one per token before BPE runs (``pre_tokenizers.Digits(individual_digits=True)``), so numbers
  are spelled digit by digit: a merged "37" would make column arithmetic harder for a small model to learn, and the
  tasks' answers are numbers;
- the special tokens, their ids and the ChatML template are the character tokenizer's (``model/tiny.py``):
  ``0 <|pad|>  1 <|endoftext|> (eos)  2 <|im_start|>  3 <|im_end|>  4 <|unk|>``, then the 256 byte symbols, then the
  merges, up to ``vocab_size`` tokens in all (fewer when the text has no more pairs worth merging);
- the role words the template writes (``system``, ``user``, ``assistant``, ``# Tools``) are part of the training
  text, so the template's lines become few tokens.

Training is deterministic: the same texts and vocab_size give the same vocabulary and merges.
"""

from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from slime_hydra.model.hf import save_tokenizer
from slime_hydra.model.tiny import CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, SPECIAL_TOKENS, UNK

ROLE_TEXT = ("system\n# Tools\n", "user\n", "assistant\n")
"""The text the chat template writes around messages, added to the training text."""
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
"""Special tokens + the byte alphabet: the smallest vocabulary a byte-level BPE tokenizer has."""


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int,
                        save_dir: Optional[str] = None) -> PreTrainedTokenizerFast:
    """Train the tokenizer described in the module docstring on ``texts``; ``vocab_size`` >= MIN_VOCAB.

    save_dir: when given, also written there (``model.hf.save_tokenizer``), to be loaded by ``model.hf.load_tokenizer``.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a byte-level BPE vocabulary needs at least {MIN_VOCAB} tokens, got vocab_size={vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(_with_roles(texts), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END], padding_side="right", clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        save_tokenizer(tokenizer, save_dir)
    return tokenizer


def _with_roles(texts: Iterable[str]) -> Iterable[str]:
    for text in texts:
        yield text
        yield from ROLE_TEXT
