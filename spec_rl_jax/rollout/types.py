"""Rollout requests, responses and the engine configuration.

Glossary:
  slot      a row of the device batch; holds one running request.
  round     one decode step of every active slot (one token each; a speculative round
            emits 1..K+1 tokens per slot).
  page      ``page_size`` consecutive KV positions of one slot (rollout/paged_cache.py).
  budget    the number of KV pages in the pool; sequences take pages as they grow and
            are preempted (offloaded or recomputed later) when it runs short.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from spec_rl_jax.rollout.scheduler import SchedulerConfig
from spec_rl_jax.sampling import SamplingParams

FINISH_REASONS = ("running", "eos", "length")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shape and policy of a rollout engine (one compile per config)."""

  num_slots: int = 8  # S
  page_size: int = 16  # Ps
  num_pages: int = 512  # P: the KV budget, in pages
  max_seq_len: int = 1024  # prompt + response, per request
  max_new_tokens: int = 256  # response cap (per-request values may be lower)
  round_budget: int = 256  # max decode rounds per device call before returning
  min_prefill_len: int = 16  # smallest prompt-length bucket (buckets double from here)
  sampling: SamplingParams = SamplingParams()  # requests' default
  eos_ids: tuple[int, ...] = ()
  seed: int = 0
  max_draft_tokens: int = 0  # K_max: the most drafts a round may propose; 0 = plain AR
  scheduler: SchedulerConfig = SchedulerConfig()  # page growth, admission, preemption

  def __post_init__(self):
    if self.max_seq_len % self.page_size:
      raise ValueError(f"max_seq_len ({self.max_seq_len}) must be a multiple of"
                       f" page_size ({self.page_size})")
    if self.max_new_tokens >= self.max_seq_len:
      raise ValueError("max_new_tokens must leave room for a prompt within max_seq_len")
    for name in ("num_slots", "page_size", "num_pages", "round_budget", "min_prefill_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.max_draft_tokens < 0:
      raise ValueError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")

  @property
  def max_pages_per_slot(self) -> int:  # M
    return self.max_seq_len // self.page_size


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt to complete. ``request_id`` seeds its RNG stream: keep it unique.

  ``sampling`` (default: the engine's) may change the temperature (0: greedy); top-k and
  top-p are compiled into the engine's programs and must match its own.
  """

  prompt: Sequence[int]
  request_id: int
  max_new_tokens: int | None = None  # None = the engine's cap
  group_id: int = -1  # requests sharing a prompt (GRPO group); -1 = none
  sampling: SamplingParams | None = None


@dataclasses.dataclass
class Response:
  """A finished request.

  ``logprobs`` are log-probabilities of ``tokens`` under the processed sampling
  distribution (temperature/top-k/top-p); ``policy_logprobs`` under the raw policy
  (softmax of the unprocessed logits) — the numbers RL uses as old-policy logprobs.
  """

  request_id: int
  prompt: list[int]
  tokens: list[int]
  logprobs: np.ndarray  # [n] float32
  policy_logprobs: np.ndarray  # [n] float32
  finish_reason: str  # "eos" | "length"
  policy_versions: np.ndarray  # [n] int32: weights version (`set_weights`) of each token


@dataclasses.dataclass
class TokenDelta:
  """Tokens a request produced since the previous `RolloutEngine.step`."""

  request_id: int
  tokens: list[int]
  logprobs: np.ndarray  # [m] float32, processed distribution
  finish_reason: str  # "running" | "eos" | "length"


@dataclasses.dataclass
class RolloutResult:
  """Responses in request order plus the batch's engine and speculative metrics.

  ``metrics``: ``rounds`` (device rounds), ``slot_rounds`` (active slot-rounds),
  ``drafted_tokens``, ``accepted_tokens``, ``acceptance_length`` (= 1 + accepted /
  speculative slot-rounds), ``acceptance_at`` (per draft position: fraction of
  speculative slot-rounds whose draft ``i`` was accepted), ``rounds_at_k`` (device
  rounds per chosen draft length ``k``), ``controller`` (the `SpecController`'s own
  counters over the call), ``resyncs`` (proposer re-prefills after calls with
  ``k = 0``), ``emitted_tokens``, ``prefills``, ``device_calls``, ``wall_s``,
  ``decode_s`` (seconds in the device loop of rounds, dispatch and any compile
  included; the rest of ``wall_s`` is prefill and host work),
  ``tokens_per_s``, ``slot_utilization`` (busy slot-rounds / (rounds x slots)) and
  ``utilization_trace`` (per device call: ``(rounds, busy fraction)``), the scheduler's
  ``admission_waits``, ``reclaimed_pages``, ``preemptions``, ``offloads``,
  ``recomputes``, ``restores``, ``offload_bytes``, ``restore_bytes``,
  ``recompute_tokens`` and ``slot_moves`` (rollout/scheduler.py).
  """

  responses: list[Response]
  metrics: dict
