"""Supervised fine-tuning (next-token, loss on the response) and the default models.

``python -m spec_rl_jax.sft`` (no arguments) builds the embedded defaults from scratch
into the cache (``$SPEC_RL_JAX_CACHE``, default ``~/.cache/spec_rl_jax``):

  tokenizer/          byte-level BPE trained on the task text (tasks/bpe.py)
  policy/, draft/     HF checkpoints (config.json, model.safetensors, tokenizer.json)
  runs/<target>/      orbax checkpoints, TensorBoard scalars, the run's tokenizer
  report.json         sizes, wall times and held-out accuracy of both models

Targets (`TARGETS`) are named `SFTConfig`s; ``--target policy`` runs one, any config
field can be overridden (``--steps 50 --data task:arithmetic``). A rerun resumes each
target from its last checkpoint (and does nothing for finished ones).

Loss: ``(1 - α)·CE(data) + α·KL(teacher || student)`` over response tokens, where
the teacher (``--teacher``, α = ``--distill_weight``) is any checkpoint sharing the
tokenizer (e.g. the draft distilling the policy; off by default, see `TARGETS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tensorboardX import SummaryWriter
from tqdm import tqdm

from spec_rl_jax import checkpoint, data, head_sft
from spec_rl_jax import eval as evaluation
from spec_rl_jax.compiles import use_persistent_cache
from spec_rl_jax.models import hf_io
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.tokenizer import Tokenizer, check_vocab
from spec_rl_jax.models.layout import (chunk_rows, training_compiler_options,
                                       training_forward_tokens)
from spec_rl_jax.models.transformer import init_decoder, teacher_forced
from spec_rl_jax.rl import losses
from spec_rl_jax.tasks.bpe import default_tokenizer, default_tokenizer_spec

# Shape legend: B batch, T time, V vocab.

@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """One SFT run. ``teacher``, ``init``: checkpoint paths, relative ones under the cache;
  ``init`` (a target name or checkpoint of the same preset) gives the starting weights
  (a curriculum stage; a missing target named there is trained first by `produce`, as
  is a head's ``teacher``)."""

  model: str = "default-policy"  # a `ModelConfig` preset
  model_overrides: tuple[tuple[str, Any], ...] = ()  # preset fields replaced
  data: tuple[str, ...] = data.DEFAULT_SOURCES  # `data.Source` specs
  steps: int = 400
  batch_size: int = 32
  max_len: int = 176  # next-token positions per example, at most
  pad_multiple: int = 32  # batches are padded to a multiple of this (few shapes)
  lr: float = 3e-3
  warmup_steps: int = 25
  end_lr_ratio: float = 0.05  # cosine decays to lr * end_lr_ratio
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  seed: int = 0
  teacher: str | None = None
  init: str | None = None
  distill_weight: float = 0.0  # α; 0 = plain SFT
  # "eagle3" | "mtp": train draft heads of the policy at ``teacher`` (frozen) instead of a
  # decoder (head_sft.py); ``head_options``: the kind's options, e.g. ttt_steps.
  head: str = ""
  head_options: tuple[tuple[str, Any], ...] = ()
  log_every: int = 10
  ckpt_every: int = 100


# The policy learns the multiplication algorithm abruptly, late in its run (token
# accuracy ~0.75 -> 0.99 within ~200 steps), and 400 steps left it mid-jump in one of
# two runs; 600 steps finish it (docs/benchmarks.md, the default recipe).
# The draft trains on the data alone: distilling the policy's logits doubles the time
# for no gain in acceptance (`eval.draft_acceptance`; docs/benchmarks.md);
# ``--teacher policy --distill_weight 0.5`` turns it on.
# ``long-*``: the long-response workload of bench/sparse.py and configs/counting_long.yaml
# (not part of "all"). The policy's curriculum (tasks/counting.py; each stage checked
# with ``python -m spec_rl_jax.eval --reference``, teacher-forced exactness):
#   count  spans 2-8: counting, carries, copying the start, the stop on short counts;
#   short  spans 2-140 with a flat stop hazard (1/40): the stop as a comparison of the
#          number just written with the prompt's end number (uniform spans teach a
#          length hazard instead, or, on short spans, a last-digit match);
#   long   spans 2-500, flat hazard 1/250: the same at up to ~2,500 positions.
# Stages, because one stage of long steps from scratch learns the tokens but not to
# count for long (its samples fall apart after a few dozen numbers); the results of each
# recipe are in docs/benchmarks.md. The draft only needs to be likely, not exact: spans
# 5-50, then the RL distribution.
_COUNT = dict(model="long-policy", data=("task:counting?min_span=2,max_span=8",),
              batch_size=128, max_len=80, pad_multiple=80, steps=300)
_SHORT = dict(model="long-policy", init="long-policy-count", batch_size=16,
              data=("task:counting?min_span=2,max_span=140,stop_hazard=0.025",),
              max_len=768, pad_multiple=64, steps=700)
_LONG = dict(model="long-policy", init="long-policy-short", batch_size=4,
             data=("task:counting?min_span=2,max_span=500,stop_hazard=0.004",),
             max_len=2304, pad_multiple=768, steps=400, lr=5e-4, warmup_steps=10)
_DRAFT_SHORT = dict(data=("task:counting?min_span=5,max_span=50",), batch_size=16,
                    max_len=256, pad_multiple=256, steps=400)
_DRAFT_LONG = dict(data=("task:counting",), batch_size=4, max_len=2304, pad_multiple=2304,
                   steps=150, lr=1e-3, warmup_steps=10)
TARGETS: dict[str, SFTConfig] = {
    "policy": SFTConfig(steps=600),
    "draft": SFTConfig(model="default-draft", steps=300),
    "eagle3": SFTConfig(head="eagle3", teacher="policy", steps=300,
                        head_options=(("feature_layers", (1, 3, 5)), ("ttt_steps", 3))),
    "mtp": SFTConfig(head="mtp", teacher="policy", steps=300,
                     head_options=(("num_modules", 4),)),
    "long-policy-count": SFTConfig(**_COUNT),
    "long-policy-short": SFTConfig(**_SHORT),
    "long-policy": SFTConfig(**_LONG),
    "long-draft-short": SFTConfig(model="long-draft", **_DRAFT_SHORT),
    "long-draft": SFTConfig(model="long-draft", init="long-draft-short", **_DRAFT_LONG),
}
DEFAULT_TARGETS = ("policy", "draft")


def make_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
  """AdamW (no decay on norm scales), warmup-cosine schedule, global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1),
      end_value=cfg.lr * cfg.end_lr_ratio)
  decay = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: not any("norm" in str(getattr(k, "key", k)) for k in path), params)
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                 mask=decay))


def _logits(graphdef, params, batch) -> jax.Array:
  """``logits[B, T, V]`` of a right-padded batch."""
  return teacher_forced(graphdef, params, batch["tokens"], batch["valid"]).logits


def sft_loss(graphdef, params, batch, teacher_logits, distill_weight: float, n):
  """``(1-α)·CE + α·KL(teacher || student)`` summed over ``batch``'s response tokens and
  divided by ``n`` (the whole step's count, so chunks add up to the step's masked mean;
  the KL is the RL learner's ``forward_kl`` drafter loss, rl/losses.py); returns
  metrics in the same form."""
  logits = _logits(graphdef, params, batch)
  logp = jax.nn.log_softmax(logits)  # [B, T, V]
  mask = batch["loss_mask"]
  ce = -(jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0] * mask).sum() / n
  acc = ((logp.argmax(-1) == batch["targets"]) * mask).sum() / n
  metrics = {"ce": ce, "token_acc": acc}
  loss = ce
  if teacher_logits is not None:
    kd = (losses.distill_loss("forward_kl", logits, teacher_logits) * mask).sum() / n
    loss = (1 - distill_weight) * ce + distill_weight * kd
    metrics["kd"] = kd
  return loss, {**metrics, "loss": loss}


def train_step(graphdef, state, batch, teacher_params=None, *, teacher_graphdef=None,
               tx, distill_weight: float = 0.0, rows: int):
  """One optimizer step on ``state = {"params", "opt", "step"}``; the batch's forward +
  backward runs as scanned chunks of ``rows`` rows (`layout.chunk_rows`: long forwards
  run slower per position on some backends), gradients and metrics summed."""
  n = jnp.maximum(batch["loss_mask"].sum(), 1.0)
  chunks = jax.tree.map(lambda x: x.reshape(x.shape[0] // rows, rows, *x.shape[1:]), batch)

  def body(acc, chunk):
    teacher_logits = (None if teacher_graphdef is None else jax.lax.stop_gradient(
        _logits(teacher_graphdef, teacher_params, chunk)))
    grad_fn = jax.value_and_grad(sft_loss, argnums=1, has_aux=True)
    (_, metrics), grads = grad_fn(graphdef, state["params"], chunk, teacher_logits,
                                 distill_weight, n)
    return jax.tree.map(jnp.add, acc, (grads, metrics)), None

  keys = ("ce", "token_acc", "loss") + (() if teacher_graphdef is None else ("kd",))
  init = (jax.tree.map(jnp.zeros_like, state["params"]), {k: jnp.float32(0) for k in keys})
  grads, metrics = jax.lax.scan(body, init, chunks)[0]
  updates, opt = tx.update(grads, state["opt"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics


def _load(what: str, name: str, tokenizer: Tokenizer):
  """The model at ``name`` (under the cache unless absolute); its tokenizer must match."""
  path = os.path.join(checkpoint.cache_dir(), name)
  model, tok = checkpoint.load_model(path)
  if tok is not None and tok.backend.to_str() != tokenizer.backend.to_str():
    raise ValueError(f"{what} {path} uses a different tokenizer than the student")
  return model


def _teacher(cfg: SFTConfig, tokenizer: Tokenizer):
  if cfg.teacher is None or cfg.distill_weight == 0:
    return None, None
  graphdef, state = nnx.split(_load("teacher", cfg.teacher, tokenizer))
  return graphdef, nnx.to_pure_dict(state)


def _initial_model(cfg: SFTConfig, model_cfg, tokenizer: Tokenizer):
  """Fresh weights, or ``cfg.init``'s (whose architecture must be ``model_cfg``)."""
  if cfg.init is None:
    return init_decoder(model_cfg, seed=cfg.seed)
  model = _load("init checkpoint", cfg.init, tokenizer)
  if model.cfg != model_cfg:
    raise ValueError(f"init checkpoint {cfg.init} is a {model.cfg}, not the {cfg.model}"
                     f" preset {model_cfg}")
  return model


def _decoder_trainee(cfg: SFTConfig, tokenizer: Tokenizer,
                     tx: optax.GradientTransformation) -> head_sft.Trainee:
  model_cfg = get_preset(cfg.model, **dict(cfg.model_overrides))
  check_vocab(tokenizer, model_cfg.vocab_size)
  graphdef, params = nnx.split(_initial_model(cfg, model_cfg, tokenizer))
  teacher_graphdef, teacher_params = _teacher(cfg, tokenizer)
  rows = chunk_rows(cfg.batch_size, cfg.max_len, training_forward_tokens(), 1)
  step_fn = jax.jit(functools.partial(train_step, graphdef, teacher_graphdef=teacher_graphdef,
                                      tx=tx, distill_weight=cfg.distill_weight, rows=rows),
                    donate_argnums=0, compiler_options=training_compiler_options())
  return head_sft.Trainee(
      params=nnx.to_pure_dict(params),
      step=lambda state, batch: step_fn(state, batch, teacher_params),
      merge=lambda state: nnx.merge(graphdef, state["params"]),
      meta={"model": checkpoint.config_to_json(model_cfg)})


def _head_trainee(cfg: SFTConfig, tokenizer: Tokenizer,
                  tx: optax.GradientTransformation) -> head_sft.Trainee:
  if cfg.teacher is None:
    raise ValueError(f"a {cfg.head} head trains against a policy: set teacher")
  decoder_only = {"model_overrides": (), "init": None, "distill_weight": 0.0}
  set_ = sorted(k for k, v in decoder_only.items() if getattr(cfg, k) != v)
  if set_:
    raise ValueError(f"{set_} configure a decoder's SFT; a {cfg.head} head is shaped by its"
                     " policy and head_options")
  options = head_sft.parse_options(cfg.head, cfg.head_options)
  policy = head_sft.load_policy(cfg.teacher, tokenizer)
  return head_sft.trainee(cfg.head, options, policy, tokenizer, cfg.seed, tx)


def train(cfg: SFTConfig, run_dir: str, tokenizer: Tokenizer,
          progress: bool = True) -> tuple[Any, dict, dict]:
  """Runs (or resumes) ``cfg`` in ``run_dir``; returns ``(model, metrics, info)``."""
  tokenizer.save(os.path.join(run_dir, checkpoint.TOKENIZER_DIR))
  tx = make_optimizer(cfg)
  trainee = (_head_trainee if cfg.head else _decoder_trainee)(cfg, tokenizer, tx)
  # One device, plainly placed: the step's outputs then match its inputs (one compile).
  state = {"params": trainee.params, "step": jnp.int32(0), **trainee.extra_state}
  state = jax.device_put({**state, "opt": tx.init(state["params"])}, jax.devices()[0])
  sources = [data.Source.parse(s) for s in cfg.data]
  batches = iter(data.sft_batches(sources, tokenizer, cfg.batch_size, cfg.max_len,
                                  seed=cfg.seed, pad_multiple=cfg.pad_multiple))
  meta = {"sft": dataclasses.asdict(cfg), **trainee.meta}
  ckpt = checkpoint.TrainCheckpointer(run_dir)
  if ckpt.latest_step() is not None:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    state, saved = ckpt.restore(abstract, batches)
    if saved != json.loads(json.dumps(meta)):
      raise ValueError(f"{run_dir} holds a run with a different config; delete it or"
                       " use another run directory")
  writer = SummaryWriter(os.path.join(run_dir, "tb"))
  start = int(state["step"])
  metrics, tokens, t0 = {}, 0, time.perf_counter()
  bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=cfg.head or cfg.model,
             disable=not progress)
  for step in bar:
    batch = next(batches)
    tokens += int(batch["valid"].sum())
    state, metrics = trainee.step(state, batch)
    done = step + 1
    if done % cfg.log_every == 0 or done == cfg.steps:
      metrics = {k: float(v) for k, v in metrics.items()}
      metrics["tokens_per_s"] = tokens / (time.perf_counter() - t0)
      for k, v in metrics.items():
        writer.add_scalar(f"train/{k}", v, done)
      bar.set_postfix({k: f"{metrics[k]:.3f}" for k in ("loss", "token_acc", "top1_agreement")
                       if k in metrics})
    if done % cfg.ckpt_every == 0 or done == cfg.steps:
      ckpt.save(done, state, batches, meta)
  ckpt.wait()
  ckpt.close()
  writer.close()
  model = trainee.merge(state)
  info = {"steps": cfg.steps, "resumed_from": start,
          "params": sum(int(x.size) for x in jax.tree.leaves(state["params"])),
          "train_s": time.perf_counter() - t0}
  return model, {k: float(v) for k, v in metrics.items()}, info


def _with_stages(targets: Sequence[str], root: str) -> list[str]:
  """``targets``, each preceded by the curriculum stages (``init`` targets) that are not
  in the cache yet."""
  order = []
  for name in targets:
    stages, cfg = [], TARGETS[name]
    needs = [cfg.init] + ([cfg.teacher] if cfg.head else [])  # a head needs its policy
    for init in needs:
      while init in TARGETS and not os.path.exists(os.path.join(root, init, "config.json")):
        stages.insert(0, init)
        init = TARGETS[init].init
    order += [s for s in stages + [name] if s not in order]
  return order


def _read_report(root: str) -> dict:
  path = os.path.join(root, "report.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _recipe(cfg: SFTConfig) -> dict:
  """``cfg`` as the JSON the report records (tuples as lists): ``recipe``, the target's
  recipe in the release that built it (what `stale_targets` compares; a model built
  with overrides is a user's choice, not stale), and ``config``, what it ran."""
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def stale_targets(targets: Sequence[str]) -> list[str]:
  """The cached ``targets`` built by another recipe than today's `TARGETS` (or from
  another default tokenizer): a cache from an older release holds models of other
  tasks, which the default run must not pick up silently."""
  root = checkpoint.cache_dir()
  report = _read_report(root)
  models = report.get("models", {})
  old_tokenizer = report.get("tokenizer_spec") != default_tokenizer_spec()
  return [t for t in targets if os.path.exists(os.path.join(root, t))
          and (old_tokenizer or not _same_recipe(models.get(t, {}).get("recipe"),
                                                 TARGETS[t]))]


def _same_recipe(built: dict | None, today: SFTConfig) -> bool:
  """Whether a model recorded as built by ``built`` is today's recipe ``today``. A field
  the record lacks was added by a later release: it matches at its default (the option
  it adds is off), so adding a field does not retrain every cache."""
  if built is None:
    return False
  now = _recipe(today)
  defaults = _recipe(SFTConfig(**{f.name: getattr(today, f.name)
                                  for f in dataclasses.fields(SFTConfig)
                                  if f.default is dataclasses.MISSING
                                  and f.default_factory is dataclasses.MISSING}))
  return set(built) <= set(now) and all(
      built[k] == v if k in built else v == defaults[k] for k, v in now.items())


def produce(targets: Sequence[str], overrides: dict[str, Any], progress: bool = True,
            eval_n: int = 100, rebuild: Sequence[str] = ()) -> dict:
  """Trains ``targets`` into the cache, exports HF checkpoints, evaluates ``eval_n``
  held-out problems per task (0: skip); returns the report. ``rebuild`` (`stale_targets`)
  are trained from scratch (their old runs deleted), with a fresh default tokenizer
  when the cached one is not today's."""
  root = checkpoint.cache_dir()
  tok_dir = os.path.join(root, "tokenizer")
  t0 = time.perf_counter()
  old = _read_report(root)
  fresh_tokenizer = bool(rebuild) and old.get("tokenizer_spec") != default_tokenizer_spec()
  for name in rebuild:
    shutil.rmtree(os.path.join(root, "runs", name), ignore_errors=True)
  if os.path.exists(os.path.join(tok_dir, "tokenizer.json")) and not fresh_tokenizer:
    tokenizer = Tokenizer.load(tok_dir)
    spec = old.get("tokenizer_spec")
  else:
    tokenizer = default_tokenizer()
    tokenizer.save(tok_dir)
    spec = default_tokenizer_spec()
  models = {} if fresh_tokenizer else old.get("models", {})  # other targets' entries stay
  report = {"cache": root, "tokenizer_vocab": tokenizer.vocab_size, "tokenizer_spec": spec,
            "models": models}
  for name in _with_stages(targets, root):
    cfg = dataclasses.replace(TARGETS[name], **(overrides if name in targets else {}))
    model, metrics, info = train(cfg, os.path.join(root, "runs", name), tokenizer,
                                 progress)
    t_eval = time.perf_counter()
    sources = [data.Source.parse(s) for s in cfg.data]
    if cfg.head:
      head_sft.head_kind(cfg.head).save(model, os.path.join(root, name))
      accuracy = ({"+".join(cfg.data): head_sft.acceptance(
          model, cfg.head, head_sft.parse_options(cfg.head, cfg.head_options),
          head_sft.load_policy(cfg.teacher, tokenizer), tokenizer, sources, eval_n,
          cfg.max_len)} if eval_n else {})
    else:
      hf_io.save_hf_checkpoint(model, os.path.join(root, name), tokenizer)
      accuracy = (evaluation.evaluate_model(model, tokenizer, sources, n=eval_n, k=4)
                  if eval_n else {})
    report["models"][name] = {
        **info, "preset": cfg.head or cfg.model, "data": [s.describe() for s in sources],
        "recipe": _recipe(TARGETS[name]), "config": _recipe(cfg),
        "final_train_metrics": metrics, "accuracy": accuracy,
        "eval_s": time.perf_counter() - t_eval}
  report["wall_s"] = time.perf_counter() - t0
  with open(os.path.join(root, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  return report


def _config_flags(parser: argparse.ArgumentParser) -> None:
  """``--<field>`` for every `SFTConfig` field (unset = the target's value)."""
  for f in dataclasses.fields(SFTConfig):
    kind = type(f.default) if f.default is not None else str
    if kind is tuple:
      parser.add_argument(f"--{f.name}", nargs="+", default=None)
    else:
      parser.add_argument(f"--{f.name}", type=kind, default=None)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--target", default="all", choices=["all", *TARGETS])
  parser.add_argument("--eval_n", type=int, default=100,
                      help="held-out problems per task in the final report (0: skip)")
  parser.add_argument("--no_progress", action="store_true")
  _config_flags(parser)
  args = parser.parse_args(argv)
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SFTConfig)
               if getattr(args, f.name) is not None}
  if "data" in overrides:
    overrides["data"] = tuple(overrides["data"])
  if "model_overrides" in overrides:  # key=value, values as JSON
    pairs = [kv.partition("=") for kv in overrides["model_overrides"]]
    overrides["model_overrides"] = tuple((k, json.loads(v)) for k, _, v in pairs)
  use_persistent_cache()
  targets = list(DEFAULT_TARGETS) if args.target == "all" else [args.target]
  # Without overrides a default target from an older recipe is rebuilt; with them, a
  # cached run of another config stops with an error (`train`) instead of being deleted.
  rebuild = [] if overrides else stale_targets(targets)
  report = produce(targets, overrides, progress=not args.no_progress, eval_n=args.eval_n,
                   rebuild=rebuild)
  print(format_report(report))


def format_report(report: dict) -> str:
  lines = [f"cache: {report['cache']}   wall time: {report['wall_s']:.0f}s"]
  for name, m in report["models"].items():
    lines.append(f"{name}: {m['preset']}, {m['params'] / 1e6:.2f}M params, "
                 f"{m['steps']} steps in {m['train_s']:.0f}s")
    for task, acc in m["accuracy"].items():
      lines.append("  " + task + ": " + ", ".join(f"{k}={v:.3f}" for k, v in acc.items()))
  return "\n".join(lines)


if __name__ == "__main__":
  main()
