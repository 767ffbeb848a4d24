"""Draft-length controllers: the ``k`` of each decode call.

The engine compiles its decode programs for draft lengths ``0..K_max`` (one program per
``(k, S_c, M_c)`` actually used, compiled on first use) and asks its controller for
``k`` before every device call. ``k = 0`` is a plain AR round: no proposer code runs.

``choose(shape)`` sees the call's live shape (`CallShape`); ``observe(stats)`` gets
each finished call's outcome (`CallStats`: rounds, per-position acceptance, device
seconds), so an adaptive controller can estimate acceptance and round costs online.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CallShape:
  """The next decode call: running sequences, slot bucket ``S_c``, page bucket ``M_c``;
  ``ar_slots``: ``S_c`` if the call runs with ``k = 0`` (smaller when only drafting reads
  other slots' rows; ``None``: the same)."""

  running: int
  slots: int
  pages: int
  ar_slots: int | None = None

  def slots_at(self, k: int) -> int:
    """``S_c`` of the call with draft length ``k``."""
    return self.ar_slots if k == 0 and self.ar_slots is not None else self.slots


@dataclasses.dataclass(frozen=True)
class CallStats:
  """One finished decode call."""

  k: int
  slots: int
  pages: int
  rounds: int  # device rounds
  slot_rounds: int  # active slot-rounds
  accepted_at: np.ndarray  # [k]: accepted drafts per position, summed over slot-rounds
  seconds: float  # wall time of the call (dispatch and any compile included)
  first_call: bool = False  # the engine's first call of this (k, slots, pages): it compiled


class SpecController:
  """Chooses the draft length of each decode call (``0 <= k <= max_draft_tokens``);
  ``stats`` holds the controller's own counters (reported in the engine's metrics)."""

  def __init__(self, max_draft_tokens: int):
    if max_draft_tokens < 0:
      raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
    self.max_draft_tokens = max_draft_tokens
    self.stats = collections.Counter()

  def choose(self, shape: CallShape) -> int:
    raise NotImplementedError

  def observe(self, stats: CallStats) -> None:
    del stats


class FixedK(SpecController):
  """Always ``k`` (default ``K_max``)."""

  def __init__(self, max_draft_tokens: int, k: int | None = None):
    super().__init__(max_draft_tokens)
    self.k = max_draft_tokens if k is None else k
    if not 0 <= self.k <= max_draft_tokens:
      raise ValueError(f"k={self.k} outside [0, {max_draft_tokens}] (max_draft_tokens)")

  def choose(self, shape: CallShape) -> int:
    del shape
    return self.k
