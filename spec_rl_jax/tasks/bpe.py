"""The project's own tokenizer: byte-level BPE trained on task text, digits kept single.

Why byte-level BPE with single digits rather than characters:

  * the fixed English of the prompts (``What is``, ``to make``) merges into a few
    tokens, so sequences, training and decoding get shorter;
  * a digit is always its own token, so place value stays aligned across operands
    (the same choice Llama and Qwen make) and arithmetic stays learnable;
  * the 256-byte base alphabet makes every string, including a user's JSONL data,
    encode and decode losslessly.

The result is a plain ``tokenizers.Tokenizer`` wrapped in `models.tokenizer.Tokenizer`
and saved in the HF layout, so it loads through the same code as any HF checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.tasks import get_task
from spec_rl_jax.tasks.base import Task, unique_records

EOS = "<|endoftext|>"
PAD = "<|pad|>"
DEFAULT_VOCAB_SIZE = 512  # upper bound; the default model presets use exactly this


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
  """Trains byte-level BPE (single digits) on ``texts``; at most ``vocab_size`` ids."""
  backend = tokenizers.Tokenizer(models.BPE())
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  backend.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  backend.train_from_iterator(texts, trainer=trainer)
  return Tokenizer(backend=backend, eos_ids=(backend.token_to_id(EOS),),
                   pad_id=backend.token_to_id(PAD))


def task_corpus(tasks: Sequence[Task], n_per_task: int = 2000, seed: int = 0) -> list[str]:
  """Prompt + answer text of ``n_per_task`` train records of each task."""
  return [f"{r['prompt']}\n{r['answer']}" for t in tasks
          for r in unique_records(t, "train", seed, n_per_task)]


DEFAULT_CORPUS = (get_task("arithmetic", max_digits=8, terms=3),
                  get_task("countdown", num_numbers=5, max_number=100, max_target=1000),
                  get_task("multiplication", max_digits=4, max_multiplier_digits=3))


def default_tokenizer_spec(vocab_size: int = DEFAULT_VOCAB_SIZE) -> str:
  """What `default_tokenizer` is trained from; a cache built from another is stale."""
  return repr((DEFAULT_CORPUS, vocab_size))


def default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
  """The tokenizer of the default models (deterministic: fixed corpus, fixed seed)."""
  return train_tokenizer(task_corpus(DEFAULT_CORPUS), vocab_size)
