"""RL prompts: records (data.py sources) → prompt ids, as a checkpointable grain stream.

A prompt is rendered with the tokenizer's chat template when it has one (one user
turn, generation prompt appended: chat-tuned HF checkpoints such as Qwen3), else with
the plain task template the default models were trained on (`data.PROMPT_TEMPLATE`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import grain
import jinja2.sandbox

from spec_rl_jax import data
from spec_rl_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
  """record → prompt ids (chat template if the tokenizer has one)."""

  tokenizer: Tokenizer

  def text(self, record: Mapping[str, str]) -> str:
    template = self.tokenizer.chat_template
    if template is None:
      return data.PROMPT_TEMPLATE.format(prompt=record["prompt"])
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": record["prompt"]}],
        add_generation_prompt=True)

  def __call__(self, record: Mapping[str, str]) -> dict:
    return {"prompt_ids": self.tokenizer.encode(self.text(record)), "record": dict(record)}


def prompt_stream(sources: Sequence[data.Source], tokenizer: Tokenizer, batch_size: int,
                  seed: int) -> grain.IterDataset:
  """Infinite batches ``{"prompt_ids": list[list[int]], "records": list[dict]}`` (a
  deterministic, seeded shuffle of finite sources; ``iter(...)`` checkpoints)."""
  return (data.mixed_records(sources, "train", seed).map(PromptEncoder(tokenizer))
          .to_iter_dataset()
          .batch(batch_size, drop_remainder=True,
                 batch_fn=lambda ex: {"prompt_ids": [e["prompt_ids"] for e in ex],
                                      "records": [e["record"] for e in ex]}))
