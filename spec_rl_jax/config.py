"""The trainer's configuration: frozen dataclasses (the one schema), YAML recipes,
dotted command-line overrides.

``load_config("configs/x.yaml", ["learner.lr=1e-5", "rollout.group_size=8"])`` reads a
recipe (a nested mapping mirroring `TrainConfig`), applies ``section.field=value``
overrides (values parsed as YAML: ``1e-5``, ``true``, ``[a, b]``) and type-checks
every field. Unknown keys are rejected with the valid alternatives named, and so is a
key written twice in one mapping (plain YAML keeps the last). The defaults of
`TrainConfig` are the CPU recipe (configs/default.yaml holds the same values).

Some fields default to a value that depends on another and are resolved when the config
is built (``learner.aggregation``: the advantage estimator's own), so the config saved
with a run holds the values it used.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from spec_rl_jax import data
from spec_rl_jax.models import attention
from spec_rl_jax.models.config import PRESETS
from spec_rl_jax.rl.advantages import ADVANTAGES, PAIRED_AGGREGATIONS, default_aggregation
from spec_rl_jax.spec import proposers
from spec_rl_jax.rl.losses import (AGGREGATIONS, DISTILL_LOSSES, DRAFT_WEIGHTINGS,
                                   POLICY_LOSSES, get_policy_loss, takes_proximal)

LONG_PROMPT_POLICIES = ("skip", "error")
RL_MODES = ("sync", "async")


class ConfigError(ValueError):
  """A recipe or override that does not fit the schema."""


def _check_choice(name: str, value: str, choices) -> None:
  if value not in choices:
    raise ConfigError(f"{name}={value!r} is not one of {sorted(choices)}")


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """The policy: a HF checkpoint directory or a training run directory.

  Relative paths are under the cache (``$SPEC_RL_JAX_CACHE``, where
  ``python -m spec_rl_jax.sft`` writes the default models).
  """

  path: str = "policy"
  mesh: tuple[int, ...] = (1, 1, 1)  # (data, fsdp, tensor)
  distributed: bool = False  # multi-host: jax.distributed.initialize() from the env
  # Paged attention of the policy and its drafters, one of attention.CHOICES; "auto":
  # the Pallas kernels on TPU, XLA elsewhere (attention.resolve_impl, run by the trainer
  # before it loads a weight: the backend is known only once JAX is initialised).
  attention_impl: str = "auto"

  def __post_init__(self):
    _check_choice("policy.attention_impl", self.attention_impl, attention.CHOICES)


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
  """Online distillation of the drafter from the policy, in the learner's update
  (rl/learner.py; losses and weightings in rl/losses.py).

  ``every``: train the drafter on every ``every``-th step's rollouts (0: frozen).
  ``loss_weight`` is λ in ``L = L_policy + λ·L_draft``; the teacher is stop-gradient, so
  with a drafter of its own parameters λ only scales the drafter's gradient (its own
  Adam state makes that nearly a no-op); it matters for drafters sharing the policy's
  parameters. The optimizer fields mean what the learner's do.
  """

  every: int = 0
  loss: str = "forward_kl"  # a key of rl.losses.DISTILL_LOSSES
  weighting: str = "uniform"  # a key of rl.losses.DRAFT_WEIGHTINGS
  reward_temperature: float = 1.0  # τ_r of the ``reward`` weighting
  loss_weight: float = 1.0  # λ
  lr: float = 1e-3
  # Adam's first steps move every weight by about ``lr``: a drafter trained from a good
  # start needs the warmup to keep its acceptance through them.
  warmup_steps: int = 10
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.99

  def __post_init__(self):
    _check_choice("drafter.train.loss", self.loss, DISTILL_LOSSES)
    _check_choice("drafter.train.weighting", self.weighting, DRAFT_WEIGHTINGS)
    for name in ("every", "loss_weight", "warmup_steps", "weight_decay"):
      if getattr(self, name) < 0:
        raise ConfigError(f"drafter.train.{name} must be >= 0, got {getattr(self, name)}")
    for name in ("reward_temperature", "lr", "clip_norm"):
      if not getattr(self, name) > 0:
        raise ConfigError(f"drafter.train.{name} must be > 0, got {getattr(self, name)}")


def _drafter_post_init(self) -> None:
  _check_choice("drafter.proposer", self.proposer, proposers.registry())
  K = self.num_draft_tokens
  if isinstance(K, str):
    if K != "auto":
      raise ConfigError(f"drafter.num_draft_tokens must be an integer >= 0 or 'auto', got"
                        f" {K!r}")
    if self.max_draft_tokens < 1:
      raise ConfigError("drafter.num_draft_tokens=auto needs drafter.max_draft_tokens >= 1,"
                        f" got {self.max_draft_tokens}")
  elif not 0 <= K <= self.max_draft_tokens:
    raise ConfigError(f"drafter.num_draft_tokens must be in [0, drafter.max_draft_tokens ="
                      f" {self.max_draft_tokens}] or 'auto', got {K}")


def _drafter_options(self) -> Any:
  """The chosen proposer's ``Config`` (its section of this config)."""
  return getattr(self, self.proposer)


def _drafter_adaptive(self) -> bool:
  """Whether each decode call's draft length is chosen online (``auto``)."""
  return self.num_draft_tokens == "auto"


def _drafter_k_max(self) -> int:
  """The most drafts a round may propose (0: plain AR rollouts)."""
  return self.max_draft_tokens if self.adaptive else self.num_draft_tokens


# Speculative rollouts: ``num_draft_tokens`` drafts per round from ``proposer`` (0 = plain
# AR; ``auto``: each decode call picks 0..``max_draft_tokens``, spec/adaptive.py), and
# online training of the drafter (``train``), and one section per registered proposer
# holding its own frozen ``Config``
# (``drafter: {proposer: ngram, num_draft_tokens: 4, ngram: {max_ngram: 4}}``), so a
# new proposer registers its options without an edit here.
DrafterConfig = dataclasses.make_dataclass(
    "DrafterConfig",
    [("proposer", str, dataclasses.field(default="draft_model")),
     ("num_draft_tokens", int | str, dataclasses.field(default="auto")),
     ("max_draft_tokens", int, dataclasses.field(default=4)),
     ("train", DrafterTrainConfig, dataclasses.field(default=DrafterTrainConfig()))]
    + [(name, cls.Config, dataclasses.field(default=cls.Config()))
       for name, cls in sorted(proposers.registry().items())],
    frozen=True,
    namespace={"__post_init__": _drafter_post_init, "options": property(_drafter_options),
               "adaptive": property(_drafter_adaptive), "k_max": property(_drafter_k_max),
               "__module__": __name__,
               "__doc__": "Speculative rollouts: drafts per round (a fixed K, or ``auto``"
                          " up to ``max_draft_tokens``) from ``proposer``; one section"
                          " of options per registered proposer."})


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Sampling G responses per prompt through the rollout engine."""

  prompts_per_step: int = 16  # B
  group_size: int = 8  # G
  max_prompt_len: int = 16
  max_new_tokens: int = 176
  on_long_prompt: str = "skip"  # "skip" (counted, logged) | "error"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  num_slots: int = 64
  page_size: int = 16
  num_pages: int = 1024
  round_budget: int = 64
  seed: int = 0
  # Placement: [] generates on the policy's mesh (rollouts and updates share the
  # devices); a (data, fsdp, tensor) shape, on devices of its own from ``first_device``
  # (default: right after the policy's), gets the weights copied across every update.
  mesh: tuple[int, ...] = ()
  first_device: int | None = None

  def __post_init__(self):
    _check_choice("rollout.on_long_prompt", self.on_long_prompt, LONG_PROMPT_POLICIES)
    if self.mesh and (len(self.mesh) != 3 or min(self.mesh) < 1):
      raise ConfigError(f"rollout.mesh must be [] or [data, fsdp, tensor] of positive"
                        f" sizes, got {list(self.mesh)}")
    if self.first_device is not None and (not self.mesh or self.first_device < 0):
      raise ConfigError(f"rollout.first_device={self.first_device} needs a rollout.mesh"
                        " and a device index >= 0")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """GRPO-family update: estimator, loss, aggregation, optimizer, batching."""

  advantage: str = "grpo"  # a key of rl.advantages.ADVANTAGES
  loss: str = "ppo_clip"  # a key of rl.losses.POLICY_LOSSES
  # A key of rl.losses.AGGREGATIONS; None: the advantage's own (dr_grpo: seq_sum_norm,
  # the others token_mean), resolved when the config is built.
  aggregation: str | None = None
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.2
  kl_coef: float = 0.0  # β; > 0 keeps a frozen reference copy of the initial policy
  # c in decoupled_ppo's truncated importance weight min(π_prox / π_behav, c)
  importance_cap: float = 5.0
  adv_eps: float = 1e-6
  lr: float = 5e-5
  warmup_steps: int = 2
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.99
  num_minibatches: int = 1  # optimizer steps per global batch
  micro_batch_size: int = 32  # responses per forward/backward (gradient accumulation)
  max_nan_streak: int = 3  # non-finite updates in a row before the run stops
  # Recompute each layer in the backward pass (policy and trained drafter): the update
  # then keeps one layer's input per layer instead of all its intermediates.
  rematerialize: bool = False

  def __post_init__(self):
    _check_choice("learner.advantage", self.advantage, ADVANTAGES)
    _check_choice("learner.loss", self.loss, POLICY_LOSSES)
    if self.aggregation is None:
      object.__setattr__(self, "aggregation", default_aggregation(self.advantage))
    _check_choice("learner.aggregation", self.aggregation, AGGREGATIONS)
    if not self.importance_cap > 0:
      raise ConfigError(f"learner.importance_cap must be > 0, got {self.importance_cap}")
    paired = PAIRED_AGGREGATIONS.get(self.advantage)
    if paired is not None and self.aggregation != paired:
      logging.warning("learner.advantage=%s comes with learner.aggregation=%s, but the"
                      " config sets %s: kept; leave learner.aggregation unset to use %s",
                      self.advantage, paired, self.aggregation, paired)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompts (`spec_rl_jax.data.Source` specs) and held-out evaluation."""

  sources: tuple[str, ...] = data.DEFAULT_SOURCES
  default_reward: str = "math"  # reward of records without a "task" field
  format_weight: float = 0.0  # w in r = correct + w * well_formed (rl/rewards.py)
  seed: int = 0
  eval_n: int = 100  # held-out prompts per source (0: no evaluation)
  eval_k: int = 4  # samples per held-out prompt
  eval_every: int = 20  # steps between evaluations (0: only before and after)

  def __post_init__(self):
    if not 0.0 <= self.format_weight <= 1.0:
      raise ConfigError(f"data.format_weight must be in [0, 1], got {self.format_weight}")
    for i, spec in enumerate(self.sources):
      try:
        source = data.Source.parse(spec)
      except ValueError as e:
        raise ConfigError(f"data.sources[{i}]: {e}") from e
      if self.eval_n and not source.held_out_is_disjoint:
        logging.warning("data.sources[%d] %r: training reads the whole file, so the"
                        " evaluation records (its first data.eval_n=%d) are training data;"
                        " add ?heldout=FRACTION (e.g. jsonl:PATH?heldout=0.05) for a"
                        " disjoint held-out split", i, spec, self.eval_n)


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """How rollouts and updates interleave (rl/pipeline.py).

  ``sync``: step t's rollouts come from the policy after t updates (staleness 0).
  ``async``: step t+1's rollouts are generated while step t's update runs, by the
  policy of ``max(t + 1 - max_staleness, last barrier)`` updates (a checkpoint or an
  evaluation step is a barrier); ``max_staleness: 0`` is the sync run, bit for bit.
  Stale rollouts want ``learner.loss: decoupled_ppo`` (rl/losses.py).
  """

  mode: str = "sync"
  max_staleness: int = 0  # N: no token trained on was sampled more than N updates ago

  def __post_init__(self):
    _check_choice("rl.mode", self.mode, RL_MODES)
    if self.max_staleness < 0:
      raise ConfigError(f"rl.max_staleness must be >= 0, got {self.max_staleness}")
    if self.mode == "sync" and self.max_staleness:
      raise ConfigError(f"rl.max_staleness={self.max_staleness} needs rl.mode=async (sync"
                        " rollouts are never stale)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 10  # steps between (async) checkpoints; the last step always saves
  max_to_keep: int = 2


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """What the memory plan (spec_rl_jax/plan.py) reads from the recipe when the
  checkpoints or the chips are not at hand.

  ``policy_model`` / ``draft_model``: a `models.config` preset naming the architecture
  of ``policy.path`` / ``drafter.draft_model.path`` (checked against the checkpoint's
  own config wherever it exists). ``chip``: a key of `plan.CHIPS`, for devices that do
  not report their memory and for planning away from the hardware.
  """

  chip: str = ""
  policy_model: str = ""
  draft_model: str = ""

  def __post_init__(self):
    for name in ("policy_model", "draft_model"):
      if getattr(self, name):
        _check_choice(f"plan.{name}", getattr(self, name), PRESETS)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One RL run. ``run_dir`` empty: a fresh ``runs/<timestamp>`` directory."""

  run_dir: str = ""
  steps: int = 60
  progress: bool = True
  policy: PolicyConfig = PolicyConfig()
  drafter: DrafterConfig = DrafterConfig()
  rollout: RolloutConfig = RolloutConfig()
  learner: LearnerConfig = LearnerConfig()
  data: DataConfig = DataConfig()
  rl: RLConfig = RLConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  plan: PlanConfig = PlanConfig()

  def __post_init__(self):
    if self.rl.max_staleness and not takes_proximal(get_policy_loss(self.learner.loss)):
      logging.warning("rl.max_staleness=%d with learner.loss=%s: stale rollouts are"
                      " trained on without an off-policy correction (learner.loss="
                      "decoupled_ppo corrects them)", self.rl.max_staleness,
                      self.learner.loss)


class _RecipeLoader(yaml.SafeLoader):
  """A safe YAML loader that rejects a key written twice in one mapping, naming both
  lines (``where``: the file, or the override, the text came from)."""

  where = "<recipe>"

  def construct_mapping(self, node, deep=False):
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":
        continue  # ``<<: *base`` merges defaults that explicit keys may override
      key = self.construct_object(key_node, deep=True)
      line = key_node.start_mark.line + 1
      try:
        if key in first_line:
          raise ConfigError(f"{self.where}:{line}: duplicate key {key!r} (first at line"
                            f" {first_line[key]}); YAML would keep only the last")
        first_line[key] = line
      except TypeError:  # an unhashable key: the base constructor reports it
        continue
    return super().construct_mapping(node, deep)


def _load_yaml(stream, where: str) -> Any:
  """The YAML document in ``stream`` (text or a file), read by `_RecipeLoader`."""
  loader = _RecipeLoader(stream)
  loader.where = where
  try:
    return loader.get_single_data()
  finally:
    loader.dispose()


def _unknown(key: str, where: str, valid: Sequence[str]) -> ConfigError:
  close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  return ConfigError(f"unknown config key {where}{key!r}{hint}; valid keys:"
                     f" {', '.join(sorted(valid))}")


def _coerce(value: Any, kind: Any, name: str) -> Any:
  """``value`` checked (and lists made tuples) against the annotation ``kind``."""
  if dataclasses.is_dataclass(kind):
    if not isinstance(value, Mapping):
      raise ConfigError(f"{name} must be a mapping, got {value!r}")
    return from_dict(kind, value, prefix=f"{name}.")
  if isinstance(kind, types.UnionType):  # the first arm the value fits
    for arm in typing.get_args(kind):
      try:
        return _coerce(value, arm, name)
      except ConfigError:
        pass
    raise ConfigError(f"{name} must be one of"
                      f" {' | '.join(a.__name__ for a in typing.get_args(kind))}, got {value!r}")
  if typing.get_origin(kind) is tuple:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{name} must be a list, got {value!r}")
    item = typing.get_args(kind)[0]
    return tuple(_coerce(v, item, f"{name}[{i}]") for i, v in enumerate(value))
  if kind is float and isinstance(value, str):  # YAML 1.1 reads ``1e-5`` as a string
    try:
      value = float(value)
    except ValueError:
      pass
  ok = {bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        type(None): lambda v: v is None}[kind]
  if not ok(value):
    raise ConfigError(f"{name} must be {kind.__name__}, got {value!r}")
  return float(value) if kind is float else value


def from_dict(cls: type, d: Mapping[str, Any], prefix: str = "") -> Any:
  """``cls`` (a config dataclass) from a nested mapping; missing fields keep defaults."""
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  kwargs = {}
  for key, value in d.items():
    if key not in names:
      raise _unknown(key, prefix, names)
    kwargs[key] = _coerce(value, hints[key], prefix + key)
  return cls(**kwargs)


def to_dict(cfg: Any) -> dict[str, Any]:
  """The nested plain-data form of a config (YAML/JSON ready; tuples as lists)."""
  def plain(v):
    if isinstance(v, (tuple, list)):
      return [plain(x) for x in v]
    if isinstance(v, dict):
      return {k: plain(x) for k, x in v.items()}
    return v
  return plain(dataclasses.asdict(cfg))


def apply_override(d: dict[str, Any], override: str) -> None:
  """Sets ``a.b.c=value`` in the nested mapping ``d`` (value parsed as YAML)."""
  key, eq, raw = override.partition("=")
  if not eq or not key:
    raise ConfigError(f"bad override {override!r}: expected section.field=value")
  *path, leaf = key.split(".")
  node = d
  for part in path:
    node = node.setdefault(part, {})
    if not isinstance(node, dict):
      raise ConfigError(f"bad override {override!r}: {part!r} is not a section")
  node[leaf] = _load_yaml(raw, f"override {override!r}")


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
  """The recipe at ``path`` (None: the defaults) with dotted ``overrides`` applied."""
  d: dict[str, Any] = {}
  if path is not None:
    with open(path) as f:
      d = _load_yaml(f, path) or {}
    if not isinstance(d, dict):
      raise ConfigError(f"{path}: a recipe must be a mapping of sections")
  for o in overrides:
    apply_override(d, o)
  return from_dict(TrainConfig, d)


def dump_config(cfg: TrainConfig, path: str) -> None:
  with open(path, "w") as f:
    yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


# What a resumed run may change: where it lives, how far it goes, whether it shows a bar.
RESUMABLE_CHANGES = ("run_dir", "steps", "progress")


def config_changes(recorded: Mapping[str, Any], cfg: TrainConfig) -> list[str]:
  """The dotted keys in which ``cfg`` is not the run config ``recorded`` (`to_dict`
  form, through JSON; `RESUMABLE_CHANGES` not compared). A key the record lacks was
  added by a later release: it matches at its default (the option it adds is off), so
  runs of an older release resume."""
  as_json = lambda c: json.loads(json.dumps(to_dict(c)))  # noqa: E731
  changed: list[str] = []

  def walk(rec: Mapping, now: Mapping, default: Mapping, prefix: str) -> None:
    for key in sorted(set(rec) | set(now)):
      name = prefix + key
      if name in RESUMABLE_CHANGES:
        continue
      if key not in now or (key in rec and not isinstance(now[key], dict)
                            and rec[key] != now[key]):
        changed.append(name)
      elif key not in rec:
        if now[key] != default.get(key):
          changed.append(name)
      elif isinstance(now[key], dict):
        if not isinstance(rec[key], dict):
          changed.append(name)
        else:
          walk(rec[key], now[key], default.get(key, {}), name + ".")

  walk(recorded, as_json(cfg), as_json(TrainConfig()), "")
  return changed
