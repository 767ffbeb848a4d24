"""GRPO-family RL with speculative rollouts: ``python -m spec_rl_jax.train``.

``python -m spec_rl_jax.train [--config configs/x.yaml] [--resume] [section.field=value ...]``

With no arguments it trains the default policy (``python -m spec_rl_jax.sft`` puts it
in the cache) on the built-in multiplication task (worked solutions) with speculative
rollouts drafted by the default draft model, on CPU, and reports held-out accuracy
before, during and after.

A step t (sync, staleness 0):

  1. rollout   B prompts × G samples through the engine (K drafts per round, K = 0 is
               AR); request ids ``(t·B + i)·G + g`` seed the sampling, so the future
               of a run is a function of (config, step);
  2. reward    responses decoded and scored by the records' verifiers (rl/rewards.py);
  3. update    advantages (rl/advantages.py) → PPO-clip loss on ``log π_old`` = the
               rollout's target logprobs (rl/learner.py) → new weights to the engine.

``rl.mode=async`` (rl/pipeline.py): steps 1-2 run in a rollout thread, ahead of the
learner, by the weights of ``max(t - rl.max_staleness, last barrier)`` updates (an
evaluation or a checkpoint is a barrier), while step 3 runs in the learner's thread;
every token's weights version is recorded and the learner checks the bound on every
batch. With ``learner.loss=decoupled_ppo`` the update corrects the staleness
(rl/losses.py). Per step: ``rl/staleness_*`` (histogram, mean, max over responses, of
their oldest token), ``train/iw_*`` (importance weights) and the rollout side's and
the learner's busy/idle fractions ``time/{rollout,learner}_{busy,idle}_frac``.

The run directory holds ``config.yaml`` (resolved), ``tokenizer/``, ``metrics.jsonl``,
``tb/``, ``ckpt/`` (params, optimizer, draft params, data iterator, counters, the
engine's proposer's host memory, e.g. the n-gram references; async orbax),
``reward.png`` / ``acceptance_length.png`` and ``timeline.png`` (the wall-clock
intervals of rollouts and updates). ``--resume`` continues from the last
checkpoint with the same future. A run directory is itself a ``policy.path`` (its latest
checkpoint) for the next run; ``python -m spec_rl_jax.export RUN_DIR OUT_DIR`` writes
its policy (and draft model) as HF checkpoints.

The draft model (or MTP / Eagle3 head) learns with the policy when ``drafter.train.every > 0``:
every that many steps the learner's update distils it from the policy on the step's
rollouts (rl/learner.py), and the engine drafts with the new weights from the next step
on.
``spec/draft_lag_steps`` is how many policy updates separate the policy the drafter
was last distilled from (its teacher) and the policy the next rollout samples from:
1 when it trains every step, the step count when frozen.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from spec_rl_jax import checkpoint, data, distributed, plan, sharding, sft
from spec_rl_jax import eval as evaluation
from spec_rl_jax.compiles import CompileCounter, use_persistent_cache
from spec_rl_jax.config import (RESUMABLE_CHANGES, TrainConfig, config_changes, dump_config,
                                load_config, to_dict)
from spec_rl_jax.models import attention
from spec_rl_jax.models.transformer import Decoder
from spec_rl_jax.rl import metrics as obs
from spec_rl_jax.rl.advantages import compute_advantages
from spec_rl_jax.rl.learner import Learner, pack_rollouts
from spec_rl_jax.rl.pipeline import PIPELINES, Rollouts, Schedule
from spec_rl_jax.rl.prompts import prompt_stream
from spec_rl_jax.rl.rewards import score_batch
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig, Request
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.spec.adaptive import AdaptiveK
from spec_rl_jax.spec.proposers import build_proposer

# Shape legend: B prompts per step, G group size, N = B·G responses, T time.


class NonFiniteLossError(RuntimeError):
  """Too many non-finite updates in a row (``learner.max_nan_streak``)."""


def ensure_default_models(cfg: TrainConfig) -> None:
  """Trains the built-in defaults into the cache on first use (``python -m
  spec_rl_jax.sft``), so the no-argument run works on a fresh machine."""
  wanted = [cfg.policy.path]
  if cfg.drafter.k_max and hasattr(cfg.drafter.options, "path"):  # a drafter with weights
    wanted.append(cfg.drafter.options.path)
  missing = [p for p in wanted
             if p in sft.TARGETS and not os.path.exists(checkpoint.resolve_path(p))]
  stale = sft.stale_targets([p for p in wanted if p in sft.TARGETS and p not in missing])
  if (missing or stale) and jax.process_count() > 1:
    raise RuntimeError(f"default models {missing + stale} are not in"
                       f" {checkpoint.cache_dir()} (or are from an older recipe), and"
                       f" {jax.process_count()} processes must not train them into one cache"
                       " at once: run python -m spec_rl_jax.sft on one process first, or"
                       " name the models' paths")
  if missing or stale:
    print(f"default models {missing + stale} not in {checkpoint.cache_dir()}"
          + (f" ({stale} are from an older recipe)" if stale else "")
          + ": training them first (python -m spec_rl_jax.sft, about 13 minutes on 2"
          " CPU cores)", flush=True)
    sft.produce([t for t in sft.TARGETS if t in missing + stale], {}, rebuild=stale)


def engine_config(cfg: TrainConfig, eos_ids: Sequence[int]) -> EngineConfig:
  r, K = cfg.rollout, cfg.drafter.k_max
  need = r.max_prompt_len + r.max_new_tokens + K + 1
  return EngineConfig(
      num_slots=r.num_slots, page_size=r.page_size, num_pages=r.num_pages,
      max_seq_len=-(-need // r.page_size) * r.page_size, max_new_tokens=r.max_new_tokens,
      round_budget=r.round_budget, eos_ids=tuple(eos_ids), seed=r.seed, max_draft_tokens=K,
      sampling=SamplingParams(r.temperature, r.top_k, r.top_p))


def draft_length_metrics(m: dict, k_max: int) -> dict:
  """Per step: the fraction of decode rounds at each draft length ``k`` (``spec/k_frac/k``;
  ``k = 0`` is drafting off) and, for an adaptive controller, its predicted and the
  realised tokens per slot-round."""
  rounds = max(m["rounds"], 1)
  out = {f"spec/k_frac/{k}": m["rounds_at_k"].get(k, 0) / rounds for k in range(k_max + 1)}
  c = m["controller"]
  if c.get("slot_rounds"):
    out["spec/predicted_tokens_per_slot_round"] = c["predicted_tokens"] / c["slot_rounds"]
    out["spec/realised_tokens_per_slot_round"] = c["realised_tokens"] / c["slot_rounds"]
  return out


@dataclasses.dataclass
class Counters:
  """Run counters that checkpoint with the state."""

  nan_streak: int = 0
  nan_skipped: int = 0
  long_prompts_skipped: int = 0
  draft_synced_step: int = 0  # the policy version the drafter was last distilled from
  draft_nan_skipped: int = 0


class Trainer:
  """Owns the policy, the learner, the engine, the data stream and the run directory."""

  def __init__(self, cfg: TrainConfig, resume: bool = False):
    distributed.check_run(cfg)
    self.cfg = cfg
    os.makedirs(cfg.run_dir, exist_ok=True)
    self.ckpt = checkpoint.TrainCheckpointer(cfg.run_dir, cfg.checkpoint.max_to_keep)
    if self.ckpt.latest_step() is not None and not resume:
      raise FileExistsError(f"{cfg.run_dir} already holds checkpoints: pass --resume to"
                            " continue it, or choose another run_dir")
    if distributed.is_writer():
      dump_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    r, G = cfg.rollout, cfg.rollout.group_size
    self.N = r.prompts_per_step * G
    self.T = r.max_prompt_len + r.max_new_tokens
    # The learner's mesh and the rollout engine's (the same one, or disjoint sub-meshes).
    self.mesh, self.rollout_mesh = sharding.placement(cfg.policy.mesh, cfg.rollout.mesh,
                                                      cfg.rollout.first_device)
    # The policy's and its drafters' attention: a backend without the asked-for kernels
    # stops here, before any weight (the default models' SFT included).
    impl = attention.resolve_impl(cfg.policy.attention_impl)
    logging.info("attention: %s (policy.attention_impl=%s on %s)", impl,
                 cfg.policy.attention_impl, jax.default_backend())
    ensure_default_models(cfg)
    plan.check(cfg)  # a recipe that does not fit the chips stops here, before any weight
    policy, tokenizer = checkpoint.load_model(checkpoint.resolve_path(cfg.policy.path), impl,
                                              self.mesh)
    policy.cfg = policy.cfg.replace(remat=cfg.learner.rematerialize)
    if tokenizer is None:
      raise ValueError(f"{cfg.policy.path} has no tokenizer")
    # Saved before the first step, so every run directory (even a killed one) is a
    # complete policy.path and exports with its tokenizer.
    if distributed.is_writer():
      tokenizer.save(os.path.join(cfg.run_dir, checkpoint.TOKENIZER_DIR))
    self.tokenizer = tokenizer
    # The drafter's own weights on the learner's mesh, where they train and checkpoint
    # (on several processes orbax saves no single-device array); the engine copies them.
    self.proposer = (build_proposer(cfg.drafter.proposer, policy, tokenizer, self.mesh,
                                    config=cfg.drafter.options)
                     if cfg.drafter.k_max else None)
    drafter, draft_head = self._drafter_to_train()
    self.learner = Learner(policy, cfg.learner, r.max_new_tokens, drafter, cfg.drafter.train,
                           r.temperature, draft_head)
    self.learner.check_batch_size(self.N)
    self.engine = RolloutEngine(
        policy, engine_config(cfg, tokenizer.eos_ids), tokenizer, self.proposer,
        AdaptiveK(cfg.drafter.k_max) if cfg.drafter.adaptive else None,
        mesh=self.rollout_mesh)
    self.sources = [data.Source.parse(s) for s in cfg.data.sources]
    self.batches = iter(prompt_stream(self.sources, tokenizer, r.prompts_per_step,
                                      cfg.data.seed))
    self.counters = Counters()
    self.step = 0
    # step -> the data stream's state before the step's batch (rollouts run ahead)
    self._data_states: dict[int, dict] = {}
    if resume and self.ckpt.latest_step() is not None:
      self._restore()
    self.pipeline = PIPELINES[cfg.rl.mode](
        self.engine, self.rollout,
        Schedule(self.step, cfg.steps, cfg.rl.max_staleness, self._barrier))

  def _drafter_to_train(self) -> tuple[nnx.Module | None, str | None]:
    """The proposer's model when ``drafter.train.every > 0`` and, for a draft head, its
    kind (clear errors when there is none to train)."""
    if not self.cfg.drafter.train.every:
      return None, None
    if self.proposer is None:
      raise ValueError("drafter.train.every > 0 but the rollouts do not draft"
                       " (drafter.num_draft_tokens=0): there is no drafter to train")
    if self.proposer.model() is None:
      raise ValueError(f"drafter.train.every > 0 but the {self.cfg.drafter.proposer!r}"
                       " proposer has no weights to train (use drafter.proposer=draft_model,"
                       " or drafter.train.every=0)")
    drafter = self.proposer.model()
    if isinstance(drafter, Decoder):
      drafter.cfg = drafter.cfg.replace(remat=self.cfg.learner.rematerialize)
      return drafter, None
    return drafter, self.proposer.name

  # ------------------------------------------------------------------ checkpoints

  def _ckpt_state(self) -> dict:
    """The learner's state and the counters; ``draft`` holds the drafter's whole state,
    trained or not (with a head's untrained variables, e.g. Eagle3's ``d2t``, which the
    learner keeps apart: export reads the whole head from it)."""
    state = {**self.learner.state,
             "counters": {k: np.int64(v) for k, v in dataclasses.asdict(self.counters).items()}}
    drafter = self.learner.draft_model()
    if drafter is None and self.proposer is not None:
      drafter = self.proposer.model()
    if drafter is not None:
      state["draft"] = nnx.to_pure_dict(nnx.state(drafter))
    return state

  def _meta(self) -> dict:
    resumable = {k: v for k, v in to_dict(self.cfg).items() if k not in RESUMABLE_CHANGES}
    meta = {"config": resumable, "rng": {"rollout_seed": self.cfg.rollout.seed,
                                         "next_request_id": self.step * self.N},
            "model": checkpoint.config_to_json(self.learner.model().cfg),
            "proposer_memory": self.proposer.host_state() if self.proposer else {}}
    drafter = self.proposer.model() if self.proposer is not None else None
    # The drafter's architecture, so its weights (state["draft"]) export on their own.
    if isinstance(drafter, Decoder):
      meta["draft_model"] = checkpoint.config_to_json(drafter.cfg)
    elif drafter is not None:
      meta["draft_head"] = {"kind": self.proposer.name, **dataclasses.asdict(drafter.cfg)}
    return meta

  def save(self) -> None:
    self.ckpt.save(self.step, self._ckpt_state(), self.batches, self._meta())

  def _save_after_rollout_failure(self) -> None:
    """Checkpoints the updates made since the last checkpoint when a step's rollouts
    failed (the exception then stops the run), so that nothing the learner did is lost.

    The data stream is rewound to the learner's step (in async mode the rollout side
    draws batches ahead), so ``--resume`` regenerates that step's rollouts from its
    prompts; the step becomes a barrier (rl/pipeline.py). The proposer's host memory
    (n-gram references) is kept as it is: it may hold responses of the steps drawn
    ahead, which changes what is drafted, never what is sampled.
    """
    last = self.ckpt.latest_step()
    if self.step == 0 or (last is not None and last >= self.step):
      return
    if self.step in self._data_states:
      self.batches.set_state(self._data_states[self.step])
    logging.error("step %d's rollouts failed: checkpointing the %d updates made so far",
                  self.step + 1, self.step)
    try:
      self.save()
    except Exception:  # noqa: BLE001  the rollouts' exception is the one to raise
      logging.exception("the checkpoint after the rollouts' failure failed")

  def _restore(self) -> None:
    # Restored onto the live state's shardings: each process reads only its shards.
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=getattr(x, "sharding", None)), self._ckpt_state())
    state, meta = self.ckpt.restore(abstract, self.batches)
    changed = config_changes(meta["config"], self.cfg)
    if changed:
      raise ValueError(f"{self.cfg.run_dir} holds a run with another config:"
                       f" {', '.join(changed)} differ (only {', '.join(RESUMABLE_CHANGES)}"
                       " may change on --resume)")
    self.step = int(self.ckpt.latest_step())
    self.counters = Counters(**{k: int(v) for k, v in state.pop("counters").items()})
    drafter = None
    if "draft" in state:
      drafter = nnx.merge(nnx.graphdef(self.proposer.model()), state.pop("draft"))
      if self.learner.draft_model() is not None:  # the learner trains its parameters
        state["draft"] = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))
    self.learner.state = state
    self.engine.set_weights(self.learner.model(), drafter, version=self.step)
    if self.proposer is not None:
      self.proposer.load_host_state(meta["proposer_memory"])

  # ------------------------------------------------------------------ one step

  def _prompts(self, t: int) -> tuple[list[list[int]], list[dict], int]:
    """Step t's prompts that fit ``max_prompt_len`` (others: skip or error), and how
    many were skipped."""
    batch = next(self.batches)
    limit, keep = self.cfg.rollout.max_prompt_len, []
    for ids, record in zip(batch["prompt_ids"], batch["records"]):
      if len(ids) <= limit:
        keep.append((ids, record))
        continue
      if self.cfg.rollout.on_long_prompt == "error":
        raise ValueError(f"prompt of {len(ids)} tokens exceeds rollout.max_prompt_len="
                         f"{limit}: {record['prompt'][:80]!r} (set rollout.on_long_prompt"
                         "=skip to drop such prompts)")
      logging.warning("skipping a prompt of %d tokens (rollout.max_prompt_len=%d) at step"
                      " %d", len(ids), limit, t + 1)
    if not keep:
      raise ValueError(f"every prompt of step {t}'s batch exceeds"
                       f" rollout.max_prompt_len={limit}")
    return [k[0] for k in keep], [k[1] for k in keep], len(batch["prompt_ids"]) - len(keep)

  def rollout(self, t: int) -> Rollouts:
    """Step t's rollouts by the engine's current weights: B prompts × G samples,
    rewarded, with advantages, packed with each token's staleness against version t
    (the learner's when it trains on them). Runs in the rollout thread in async mode
    (rl/pipeline.py)."""
    G, B = self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
    self._data_states[t] = self.batches.get_state()
    prompts, records, skipped = self._prompts(t)
    requests = [Request(p, request_id=(t * B + i) * G + g, group_id=t * B + i)
                for i, p in enumerate(prompts) for g in range(G)]
    t0 = time.perf_counter()
    with CompileCounter() as rollout_compiles:
      result = self.engine.generate(requests)
    t1 = time.perf_counter()
    texts = [self.tokenizer.decode(r.tokens) for r in result.responses]
    scores = score_batch([rec for rec in records for _ in range(G)], texts,
                         self.cfg.data.default_reward, self.cfg.data.format_weight)
    rewards = scores.reward
    adv = compute_advantages(self.cfg.learner.advantage, rewards.reshape(-1, G),
                             self.cfg.learner.adv_eps)
    batch = pack_rollouts([r.prompt for r in result.responses],
                          [r.tokens for r in result.responses],
                          [r.policy_logprobs for r in result.responses], adv.reshape(-1),
                          rewards, self.T, self.tokenizer.pad_id,
                          lags=[t - r.policy_versions for r in result.responses])
    t2 = time.perf_counter()
    lengths = np.asarray([len(r.tokens) for r in result.responses])
    m = result.metrics
    metrics = {
        "rollout/reward_mean": float(rewards.mean()), "rollout/reward_std": float(rewards.std()),
        "rollout/accuracy": float(scores.correct.mean()),
        "rollout/well_formed_frac": float(scores.well_formed.mean()),
        "rollout/unreadable_frac": float(1.0 - scores.readable.mean()),
        "rollout/response_len": float(lengths.mean()),
        "rollout/truncated_frac": float(np.mean([r.finish_reason == "length"
                                                 for r in result.responses])),
        "rollout/tokens_per_s": m["tokens_per_s"],
        "spec/acceptance_length": m["acceptance_length"],
        "spec/acceptance_at": m["acceptance_at"],
        **draft_length_metrics(m, self.cfg.drafter.k_max),
        "time/rollout_s": t1 - t0, "time/reward_s": t2 - t1,
        "time/rollout_decode_s": m["decode_s"],  # the device loop; the rest: prefill, host
        # XLA compile seconds inside the phase (new shapes), included in its time
        "time/rollout_compile_s": rollout_compiles.seconds,
    }
    return Rollouts(t, _pad_rows(batch, self.N), metrics, skipped)

  def train_step(self, bar: tqdm) -> dict:
    """One step: step t's rollouts from the pipeline, the update, the new weights
    (version t + 1) handed back. Async mode's barriers (evaluation, checkpoints) are
    `run`'s."""
    t = self.step
    bar.set_description(f"step {t + 1} rollout")
    t0 = time.perf_counter()
    try:
      rollouts = self.pipeline.get(t)
    except Exception:
      self._save_after_rollout_failure()
      raise
    self.counters.long_prompts_skipped += rollouts.long_prompts_skipped
    staleness = self._check_staleness(rollouts.batch)
    bar.set_description(f"step {t + 1} update")
    every = self.cfg.drafter.train.every
    train_draft = bool(every) and t % every == 0
    t2 = time.perf_counter()
    with CompileCounter() as update_compiles:
      learn = self.learner.update(rollouts.batch, train_draft)
      self.pipeline.publish(t + 1, self.learner.model(),
                            self.learner.draft_model() if train_draft else None)
      jax.block_until_ready(self.learner.state)
    t3 = time.perf_counter()
    self.pipeline.updates.append([t, t2, t3])
    self._check_finite(learn)
    if train_draft:
      self._check_draft(learn)
    self._data_states.pop(t, None)
    self.step += 1
    return {
        **rollouts.metrics,
        "spec/draft_lag_steps": (self.step - self.counters.draft_synced_step
                                 if self.proposer is not None
                                 and self.proposer.model() is not None else 0),
        **staleness,
        **{f"train/{k}": v for k, v in learn.items()},
        "train/nan_skipped_total": self.counters.nan_skipped,
        "train/draft_nan_skipped_total": self.counters.draft_nan_skipped,
        "data/long_prompts_skipped": self.counters.long_prompts_skipped,
        "time/update_s": t3 - t2, "time/step_s": t3 - t0,
        **self.pipeline.timing((t0, t3)),
        "time/update_compile_s": update_compiles.seconds,
    }

  def _check_staleness(self, batch: dict[str, np.ndarray]) -> dict:
    """Per response, its oldest token's staleness (updates between the weights that
    sampled it and the learner's): histogram over ``0..max_staleness``, mean and max.
    Training on a batch beyond ``rl.max_staleness`` is an error."""
    rows = batch["mask"].sum(axis=1) > 0
    lag = np.where(batch["mask"] > 0, batch["lag"], 0).max(axis=1)[rows]
    N = self.cfg.rl.max_staleness
    if lag.max() > N:
      raise RuntimeError(f"step {self.step + 1}'s rollouts are {lag.max()} updates stale;"
                         f" rl.max_staleness={N}")
    return {"rl/staleness_hist": (np.bincount(lag, minlength=N + 1) / lag.size).tolist(),
            "rl/staleness_mean": float(lag.mean()), "rl/staleness_max": int(lag.max())}

  def _check_finite(self, learn: dict) -> None:
    if not learn["skipped"]:
      self.counters.nan_streak = 0
      return
    self.counters.nan_streak += 1
    self.counters.nan_skipped += 1
    limit = self.cfg.learner.max_nan_streak
    logging.warning("step %d: non-finite loss or gradient, update skipped (%d in a row)",
                    self.step + 1, self.counters.nan_streak)
    if self.counters.nan_streak >= limit:
      raise NonFiniteLossError(
          f"stopping at step {self.step + 1}: {self.counters.nan_streak} non-finite"
          f" updates in a row (learner.max_nan_streak={limit}); the parameters are those"
          " of the last finite update. Lower learner.lr or check the rewards and data.")

  def _check_draft(self, learn: dict) -> None:
    """A drafter update that went through syncs it to this step's policy (its teacher);
    a non-finite one was skipped (the policy's update is unaffected) and is counted."""
    if not learn["draft_skipped"]:
      self.counters.draft_synced_step = self.step
      return
    self.counters.draft_nan_skipped += 1
    logging.warning("step %d: non-finite drafter loss or gradient, drafter update skipped"
                    " (%d so far); the policy's update went ahead", self.step + 1,
                    self.counters.draft_nan_skipped)

  # ------------------------------------------------------------------ the run

  def _evaluates_after(self, step: int) -> bool:
    d = self.cfg.data
    return bool(d.eval_n and d.eval_every and step % d.eval_every == 0
                and step < self.cfg.steps)

  def _saves_after(self, step: int) -> bool:
    return step % self.cfg.checkpoint.every == 0 or step == self.cfg.steps

  def _barrier(self, step: int) -> bool:
    """Whether `run` evaluates or checkpoints after ``step`` updates: the rollouts of
    step ``step`` wait for it (rl/pipeline.py)."""
    return self._evaluates_after(step) or self._saves_after(step)

  def evaluate(self) -> dict:
    d = self.cfg.data
    acc = evaluation.evaluate(self.engine, self.tokenizer, self.sources, n=d.eval_n,
                              k=d.eval_k, seed=d.seed)
    return {f"eval/{task}/{k}": v for task, res in acc.items() for k, v in res.items()
            if k != "n"}

  def run(self) -> dict:
    """Trains to ``cfg.steps``; returns ``{"eval_before", "eval_after", "steps"}``."""
    cfg = self.cfg
    log = obs.MetricsLogger(cfg.run_dir)
    summary = {"resumed_from": self.step}
    if cfg.data.eval_n and self.step == 0:
      summary["eval_before"] = self.evaluate()
      log.log(0, summary["eval_before"])
    bar = tqdm(total=cfg.steps, initial=self.step,
               disable=not (cfg.progress and distributed.is_writer()))
    while self.step < cfg.steps:
      metrics = self.train_step(bar)
      with (self.pipeline.exclusive(self.step) if self._barrier(self.step)
            else contextlib.nullcontext()):
        if self._evaluates_after(self.step):
          metrics.update(self.evaluate())
        log.log(self.step, metrics)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                        acc_len=f"{metrics['spec/acceptance_length']:.2f}",
                        gap=f"{metrics['train/logprob_gap']:.1e}")
        if self._saves_after(self.step):
          self.save()
    bar.close()
    if cfg.data.eval_n:
      summary["eval_after"] = self.evaluate()
      log.log(self.step, summary["eval_after"])
    self.ckpt.wait()
    log.close()
    if distributed.is_writer():
      summary["plots"] = obs.plot_curves(cfg.run_dir)
      summary["timeline"] = obs.plot_timeline(
          os.path.join(cfg.run_dir, "timeline.png"),
          {"rollout": self.pipeline.rollouts, "update": self.pipeline.updates})
    summary["steps"] = self.step
    return summary

  def close(self) -> None:
    self.pipeline.close()
    self.ckpt.close()


def _pad_rows(batch: dict[str, np.ndarray], N: int) -> dict[str, np.ndarray]:
  """Pads a packed batch to ``N`` rows (skipped prompts: rows without response tokens,
  so they carry no loss weight and the update keeps one compiled shape)."""
  n = batch["adv"].shape[0]
  return {k: np.concatenate([v, np.zeros((N - n, *v.shape[1:]), v.dtype)])
          for k, v in batch.items()}


def main(argv: Sequence[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=None, help="a YAML recipe (configs/*.yaml)")
  parser.add_argument("--resume", action="store_true",
                      help="continue the run in run_dir from its last checkpoint")
  parser.add_argument("overrides", nargs="*", help="section.field=value")
  args = parser.parse_args(argv)
  cfg = load_config(args.config, args.overrides)
  use_persistent_cache()
  if cfg.policy.distributed:
    distributed.initialize()
  if not cfg.run_dir:
    if args.resume:
      raise ValueError("--resume needs run_dir=<the run's directory>")
    if cfg.policy.distributed:  # each process would name its own, by its clock
      raise ValueError("policy.distributed=true needs run_dir=<a directory every process"
                       " reaches>")
    cfg = dataclasses.replace(cfg, run_dir=os.path.join("runs",
                                                        time.strftime("%Y%m%d-%H%M%S")))
  trainer = Trainer(cfg, resume=args.resume)
  try:
    summary = trainer.run()
  finally:
    trainer.close()
  if not distributed.is_writer():
    return summary
  print(f"run directory: {cfg.run_dir}")
  for phase in ("eval_before", "eval_after"):
    if phase in summary:
      print(phase + ": " + ", ".join(f"{k[5:]}={v:.3f}" for k, v in summary[phase].items()))
  return summary


if __name__ == "__main__":
  main()
