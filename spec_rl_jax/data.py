"""Data: prompt/answer records from task generators or JSONL files, as grain pipelines.

A *record* is ``{"prompt": str, "answer": str}`` plus an optional ``"task"`` naming its
reward (GSM8K schema; the built-in tasks write the same). A `Source` names where
records come from, as a CLI-friendly string::

  task:arithmetic                                 built-in generator, default difficulty
  task:countdown?num_numbers=4,max_number=30@0.5  difficulty; mixture weight 0.5
  jsonl:/data/gsm8k_train.jsonl                   a user's file (the file is the split)
  jsonl:/data/gsm8k_train.jsonl?heldout=0.05      the file, 5% of it held out

Held-out (evaluation) records, `Source.held_out`:

  * a task's: distinct problems of its test split, a hash of the problem that the
    training stream never draws (`spec_rl_jax.tasks.base`);
  * a JSONL file's with ``heldout=F`` (``0 < F < 1``): its first ``n`` records (file
    order) whose prompt hashes below ``F`` (`in_held_out`: a stable hash of the stripped
    prompt text, so duplicates land on the same side, every machine and run splits
    alike, and appending records moves none); training reads only the others;
  * a JSONL file's without ``heldout``: its first ``n`` records, the file being one
    split. That fits a separate test file (``python -m spec_rl_jax.eval --data
    jsonl:/data/gsm8k_test.jsonl``); a training source evaluated this way is evaluated
    on records it trains on, which the trainer's config warns about.

JSONL files are UTF-8 (a byte-order mark is ignored), one JSON object per line (LF or
CRLF); a record's ``prompt`` must not be empty.

Pipelines (all grain, so the iterator state is a small dict that checkpoints with the
run and restores the exact future batches):

  * `sft_batches`: record → prompt ids + response ids (+EOS) → padded batches (a few
    shapes) with a loss mask on the response,
  * RL prompt streams live in `spec_rl_jax.rl.prompts` (chat templates applied).

Finite sources are shuffled (seeded, reshuffled each epoch) and repeated; generator
sources are already random. Sources are mixed by weight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.tasks import get_task
from spec_rl_jax.tasks.base import record_at, unique_records

Record = dict[str, str]
GENERATOR_LENGTH = 2**31 - 1  # "infinite": grain map datasets need a length
PROMPT_TEMPLATE = "{prompt}\n"
DEFAULT_SOURCES = ("task:multiplication",)  # the default models' data


class JsonlError(ValueError):
  """A JSONL line that is not a prompt/answer record; names the file and line."""


def read_jsonl(path: str, skip_bad_lines: bool = False) -> list[Record]:
  """Reads prompt/answer records; blank lines are ignored.

  A line that is not a JSON object with string ``prompt`` (not blank) and ``answer``
  raises `JsonlError` naming ``path:line``; with ``skip_bad_lines`` it is skipped instead
  and the skipped lines are counted in one warning.
  """
  records, bad = [], []
  # utf-8-sig drops the byte-order mark some editors (Windows Notepad, Excel) write.
  with open(path, encoding="utf-8-sig") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        records.append(_check_record(json.loads(line)))
      except (json.JSONDecodeError, ValueError) as e:
        if not skip_bad_lines:
          raise JsonlError(f"{path}:{lineno}: {e}") from e
        bad.append(lineno)
  if bad:
    logging.warning("%s: skipped %d bad line(s): %s%s", path, len(bad), bad[:10],
                    " ..." if len(bad) > 10 else "")
  if not records:
    raise JsonlError(f"{path}: no records")
  return records


def _check_record(obj: Any) -> Record:
  if not isinstance(obj, dict):
    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
  for field in ("prompt", "answer"):
    if not isinstance(obj.get(field), str):
      raise ValueError(f"field {field!r} missing or not a string")
  if not obj["prompt"].strip():
    raise ValueError("field 'prompt' is empty")
  if "task" in obj and not isinstance(obj["task"], str):
    raise ValueError("field 'task' must be a string")
  return {k: obj[k] for k in ("prompt", "answer", "task") if k in obj}


class TaskRecords(Sequence):
  """The infinite record stream of a task split, by index (a grain data source)."""

  def __init__(self, task, split: str, seed: int):
    self.task, self.split, self.seed = task, split, seed

  def __len__(self) -> int:
    return GENERATOR_LENGTH

  def __getitem__(self, index: int) -> Record:
    return record_at(self.task, self.split, self.seed, int(index))


@dataclasses.dataclass(frozen=True)
class Source:
  """Where records come from. ``kind`` is a key of `SOURCES`; ``name`` a task or path."""

  kind: str
  name: str
  params: tuple[tuple[str, Any], ...] = ()  # task difficulty; a JSONL file's heldout
  weight: float = 1.0

  @classmethod
  def parse(cls, spec: str) -> "Source":
    """``kind:name[?k=v,...][@weight]``; values are parsed as JSON (ints, floats)."""
    body, _, weight = spec.rpartition("@") if "@" in spec else (spec, "", "")
    kind, _, rest = body.partition(":")
    name, _, kv = rest.partition("?")
    if kind not in SOURCES or not name:
      raise ValueError(f"bad data source {spec!r}: expected kind:name with kind in"
                       f" {sorted(SOURCES)}")
    params = []
    for item in filter(None, kv.split(",")):
      k, eq, v = item.partition("=")
      try:
        if not eq:
          raise ValueError("expected key=value")
        params.append((k, json.loads(v)))
      except ValueError as e:
        raise ValueError(f"bad parameter {item!r} in {spec!r}: {e}") from e
    source = cls(kind, name, tuple(params), float(weight) if weight else 1.0)
    try:
      SOURCES[kind].check(source)
    except ValueError as e:
      raise ValueError(f"bad data source {spec!r}: {e}") from e
    return source

  def records(self, split: str, seed: int) -> Sequence[Record]:
    """The training stream (random access; generators are infinite)."""
    return SOURCES[self.kind].records(self, split, seed)

  def held_out(self, n: int, seed: int) -> list[Record]:
    """``n`` evaluation records (fewer if a file is shorter)."""
    return SOURCES[self.kind].held_out(self, n, seed)

  @property
  def held_out_is_disjoint(self) -> bool:
    """Whether `held_out` records are kept out of the training stream."""
    return SOURCES[self.kind].held_out_is_disjoint(self)

  def describe(self) -> dict[str, Any]:
    """What the records are (a task's full difficulty setting, a file's path)."""
    return SOURCES[self.kind].describe(self)


def source_labels(sources: Sequence[Source]) -> list[str]:
  """Result keys for ``sources``: the task or file name, with the parameters appended
  where two sources share a name (``counting?max_span=100,min_span=2``)."""
  names = [os.path.basename(s.name) for s in sources]
  return [n + "?" + ",".join(f"{k}={v}" for k, v in sorted(s.params))
          if names.count(n) > 1 and s.params else n for n, s in zip(names, sources)]


@dataclasses.dataclass(frozen=True)
class SourceKind:
  """How one kind of source yields records."""

  records: Callable[[Source, str, int], Sequence[Record]]
  held_out: Callable[[Source, int, int], list[Record]]
  describe: Callable[[Source], dict[str, Any]]
  check: Callable[[Source], None]  # raises ValueError on bad parameters
  held_out_is_disjoint: Callable[[Source], bool]


def _task(s: Source):
  return get_task(s.name, **dict(s.params))


def _jsonl_held_out_fraction(s: Source) -> float | None:
  """The ``heldout`` fraction of a JSONL source (None: the file is one split)."""
  params = dict(s.params)
  unknown = sorted(set(params) - {"heldout"})
  if unknown:
    raise ValueError(f"unknown jsonl parameter(s) {unknown}; jsonl sources take only"
                     " heldout=FRACTION")
  fraction = params.get("heldout")
  if fraction is None:
    return None
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
      or not 0 < fraction < 1:
    raise ValueError(f"heldout must be a fraction of the file in (0, 1), e.g."
                     f" heldout=0.05, got {fraction!r}")
  return float(fraction)


def in_held_out(prompt: str, fraction: float) -> bool:
  """Whether a record with ``prompt`` is in the held-out ``fraction`` of its file."""
  digest = hashlib.blake2b(prompt.strip().encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64 < fraction


def jsonl_split(s: Source, split: str) -> list[Record]:
  """The records of a JSONL source's ``split`` ("train" or "test": the held-out
  ones); without ``heldout`` every split is the whole file."""
  records = read_jsonl(s.name)
  fraction = _jsonl_held_out_fraction(s)
  if fraction is None:
    return records
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  out = [r for r in records if in_held_out(r["prompt"], fraction) == (split == "test")]
  if not out:
    raise JsonlError(f"{s.name}: heldout={fraction} leaves no {split} records of"
                     f" {len(records)}")
  return out


SOURCES: dict[str, SourceKind] = {
    # Generators: the split is a hash of the problem; held-out = distinct test problems.
    "task": SourceKind(
        records=lambda s, split, seed: TaskRecords(_task(s), split, seed),
        held_out=lambda s, n, seed: unique_records(_task(s), "test", seed, n),
        describe=lambda s: dataclasses.asdict(_task(s)),
        check=lambda s: None,  # get_task checks the difficulty when the task is built
        held_out_is_disjoint=lambda s: True),
    # Files: held-out = the first n records of the heldout split (or of the file).
    "jsonl": SourceKind(
        records=lambda s, split, seed: jsonl_split(s, split),
        held_out=lambda s, n, seed: jsonl_split(s, "test")[:n],
        describe=lambda s: {"path": os.path.abspath(s.name), **dict(s.params)},
        check=_jsonl_held_out_fraction,
        held_out_is_disjoint=lambda s: _jsonl_held_out_fraction(s) is not None),
}


def mixed_records(sources: Sequence[Source], split: str, seed: int) -> grain.MapDataset:
  """The weighted, infinite mixture of ``sources`` (finite ones shuffled per epoch)."""
  if not sources:
    raise ValueError("no data sources")
  parts = []
  for i, s in enumerate(sources):
    records = s.records(split, seed + i)
    ds = grain.MapDataset.source(records)
    if len(records) < GENERATOR_LENGTH:
      ds = ds.shuffle(seed=seed + i).repeat()
    parts.append(ds)
  return grain.MapDataset.mix(parts, [s.weight for s in sources])


@dataclasses.dataclass(frozen=True)
class SFTEncoder:
  """record → ``{"ids": prompt ids + response ids + EOS, "prompt_len": int}``.

  Prompt and response are encoded separately, so the loss-mask boundary is exact and
  the prompt ids are the ones the policy sees at rollout time.
  """

  tokenizer: Tokenizer
  template: str = PROMPT_TEMPLATE

  def prompt_ids(self, record: Mapping[str, str]) -> list[int]:
    return self.tokenizer.encode(self.template.format(prompt=record["prompt"]))

  def __call__(self, record: Mapping[str, str]) -> dict[str, Any]:
    prompt = self.prompt_ids(record)
    response = self.tokenizer.encode(record["answer"]) + [self.tokenizer.eos_ids[0]]
    return {"ids": np.asarray(prompt + response, np.int32), "prompt_len": len(prompt)}


def collate_sft(examples: Sequence[Mapping[str, Any]], pad_id: int, max_len: int,
                pad_multiple: int) -> dict[str, np.ndarray]:
  """Pads next-token examples to ``T`` = the longest rounded up to ``pad_multiple``
  (capped at ``max_len``; ``pad_multiple == max_len`` gives one fixed shape).

  Returns ``tokens[B,T]`` int32 inputs, ``targets[B,T]`` int32 next tokens,
  ``loss_mask[B,T]`` float32 (1 where the target is a response token, EOS included)
  and ``valid[B,T]`` bool (real input tokens).
  """
  longest = max(len(e["ids"]) - 1 for e in examples)
  T = min(max_len, -(-longest // pad_multiple) * pad_multiple)
  B = len(examples)
  tokens = np.full((B, T), pad_id, np.int32)
  targets = np.full((B, T), pad_id, np.int32)
  loss_mask = np.zeros((B, T), np.float32)
  valid = np.zeros((B, T), bool)
  for b, e in enumerate(examples):
    ids, n = e["ids"], len(e["ids"]) - 1
    tokens[b, :n], targets[b, :n], valid[b, :n] = ids[:-1], ids[1:], True
    loss_mask[b, e["prompt_len"] - 1:n] = 1.0
  return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask, "valid": valid}


class _FitsMaxLen(grain.transforms.Filter):
  """Drops examples longer than ``max_len`` next-token positions (warns on the first)."""

  def __init__(self, max_len: int):
    self.max_len, self.warned = max_len, False

  def filter(self, example) -> bool:
    fits = len(example["ids"]) - 1 <= self.max_len
    if not fits and not self.warned:
      logging.warning("dropping examples longer than max_len=%d tokens (first one: %d)",
                      self.max_len, len(example["ids"]) - 1)
      self.warned = True
    return fits


def sft_batches(sources: Sequence[Source], tokenizer: Tokenizer, batch_size: int,
                max_len: int, *, seed: int = 0, split: str = "train",
                pad_multiple: int | None = None,
                template: str = PROMPT_TEMPLATE) -> grain.IterDataset:
  """Infinite SFT batches (see `collate_sft`); ``iter(...)`` has ``get_state``/
  ``set_state``. ``pad_multiple`` defaults to ``max_len`` (one fixed shape)."""
  encode = SFTEncoder(tokenizer, template)
  pad_multiple = pad_multiple or max_len
  return (mixed_records(sources, split, seed).map(encode).to_iter_dataset()
          .filter(_FitsMaxLen(max_len))
          .batch(batch_size, drop_remainder=True,
                 batch_fn=lambda ex: collate_sft(ex, tokenizer.pad_id, max_len,
                                                 pad_multiple)))
