"""Exports a training run's policy (and its draft model) as Hugging Face checkpoints.

``python -m spec_rl_jax.export RUN_DIR OUT_DIR [--step N]``

Writes ``OUT_DIR/`` (``config.json``, safetensors, the run's tokenizer), which
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads and which is a
``policy.path`` for this trainer. When the run drafted with the ``draft_model``
proposer, ``OUT_DIR/draft/`` holds the draft model the same way, the weights the run
checkpointed with its policy; with ``eagle3``, ``OUT_DIR/eagle3/`` holds the head in the
serving stacks' Eagle3 layout, and with ``mtp`` ``OUT_DIR/mtp/`` the MTP heads under
DeepSeek-V3's tensor names. Proposers without weights (``ngram``, ``self_sparse``) have
nothing to export. An SFT run directory (``python -m spec_rl_jax.sft``) exports too; a
draft-head target's run (``--target eagle3`` / ``mtp``) exports its heads to ``OUT_DIR``.

The weights are read from the run's orbax checkpoint at step ``N`` (default: the
latest) by `checkpoint.restore_decoder`, the same code that opens a run directory given
as ``policy.path``. A training run directory needs no export to seed the next run:
``policy.path=RUN_DIR`` reads its latest checkpoint directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from spec_rl_jax import checkpoint
from spec_rl_jax.models import eagle3, eagle3_io, hf_io, mtp

DRAFT_SUBDIR = "draft"


def _eagle3_head(meta: dict):
  return eagle3.abstract_head(eagle3.Eagle3Config(
      **{k: v for k, v in meta.items() if k != "kind"}))


def _mtp_heads(meta: dict):
  return mtp.abstract_heads(mtp.MTPConfig(meta["num_modules"],
                                          checkpoint.config_from_json(meta["policy"]),
                                          meta["policy_fingerprint"]))


# Draft heads by proposer: (abstract heads from the run's meta, writer); each exports to
# OUT_DIR/<proposer>/ in its exchange layout.
HEAD_EXPORTS = {"eagle3": (_eagle3_head, eagle3_io.save_eagle3),
                "mtp": (_mtp_heads, mtp.save_mtp)}


@dataclasses.dataclass
class Exported:
  """What `export` wrote: the checkpoint step and the HF directories (None: not written)."""

  step: int
  policy: str
  draft: str | None
  tokenizer: bool


def open_run(run_dir: str) -> checkpoint.TrainCheckpointer:
  """The run's checkpointer; raises unless ``run_dir`` holds a ``ckpt/`` directory
  (the check comes first: the checkpointer would create one)."""
  if not os.path.isdir(os.path.join(run_dir, checkpoint.CKPT_DIR)):
    raise FileNotFoundError(f"{run_dir}: not a training run directory (no"
                            f" {checkpoint.CKPT_DIR}/ inside)")
  return checkpoint.TrainCheckpointer(run_dir)


def pick_step(ckpt: checkpoint.TrainCheckpointer, run_dir: str, step: int | None) -> int:
  """``step``, or the latest one when None; raises listing the saved steps otherwise."""
  steps = ckpt.all_steps()
  if not steps:
    raise FileNotFoundError(f"{run_dir}: no checkpoint saved yet (the run stopped before"
                            " its first checkpoint.every steps)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise ValueError(f"{run_dir}: no checkpoint at step {step}; available steps: {steps}"
                     " (checkpoint.max_to_keep keeps only the latest few)")
  return step


def no_draft_reason(meta: dict) -> str:
  """Why a checkpoint without draft weights has no draft model to export."""
  drafter = meta.get("config", {}).get("drafter")
  if drafter is None:
    return "not an RL run: no drafter"
  name = drafter["proposer"]
  if drafter["num_draft_tokens"] == 0:
    return "the run did not draft (drafter.num_draft_tokens=0)"
  if name == "draft_model":  # a run from before the meta recorded the draft's config
    return ("the checkpoint does not record the draft model's config; its weights are"
            f" the frozen ones at drafter.draft_model.path={drafter['draft_model']['path']}")
  return f"the {name} proposer has no weights"


def _export_heads(ckpt, head_meta: dict, step: int, keys: tuple[str, ...],
                  out_dir: str) -> None:
  """Writes the heads stored at ``step`` in their exchange layout: ``state["draft"]``
  (an RL run) or ``state["params"]`` and ``state["frozen"]`` (a head SFT run: trained
  parameters apart from the rest)."""
  abstract_head, save = HEAD_EXPORTS[head_meta["kind"]]
  filters = (nnx.Param, ...) if len(keys) == 2 else (...,)
  graphdef, *parts = nnx.split(abstract_head(head_meta), *filters)
  restored = [ckpt.restore_params(jax.tree.map(lambda v: jax.ShapeDtypeStruct(
      v.shape, v.dtype), nnx.to_pure_dict(part)), step, key) for part, key in zip(parts, keys)]
  save(nnx.merge(graphdef, *restored), out_dir)


def export(run_dir: str, out_dir: str, step: int | None = None,
           log: Callable[[str], None] = print) -> Exported:
  """Writes step ``step`` (None: the latest) of ``run_dir`` to ``out_dir`` (+ ``draft/``)."""
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise FileExistsError(f"{out_dir} is not empty: choose another directory or remove it"
                          " (stale weight shards would mix with the new ones)")
  ckpt = open_run(run_dir)
  try:
    step = pick_step(ckpt, run_dir, step)
    meta = ckpt.restore_meta(step)
    tokenizer = checkpoint.run_tokenizer(run_dir)
    if "model" not in meta:  # a draft-head SFT run: its heads are the whole checkpoint
      _export_heads(ckpt, meta["draft_head"], step, ("params", "frozen"), out_dir)
      log(f"{meta['draft_head']['kind']} heads of {run_dir} step {step} -> {out_dir}")
      return Exported(step, out_dir, None, False)
    if tokenizer is None:
      log(f"warning: {run_dir} has no {checkpoint.TOKENIZER_DIR}/ (a run from before runs"
          " saved it): exporting without a tokenizer")
    policy = checkpoint.restore_decoder(ckpt, checkpoint.config_from_json(meta["model"]),
                                        step)
    hf_io.save_hf_checkpoint(policy, out_dir, tokenizer)
    log(f"policy of {run_dir} step {step} -> {out_dir}")
    draft_dir = None
    if "draft_model" in meta:
      draft = checkpoint.restore_decoder(
          ckpt, checkpoint.config_from_json(meta["draft_model"]), step, key="draft")
      draft_dir = os.path.join(out_dir, DRAFT_SUBDIR)
      hf_io.save_hf_checkpoint(draft, draft_dir, tokenizer)
      log(f"draft model -> {draft_dir}")
    elif "draft_head" in meta:
      draft_dir = os.path.join(out_dir, meta["draft_head"]["kind"])
      _export_heads(ckpt, meta["draft_head"], step, ("draft",), draft_dir)
      log(f"{meta['draft_head']['kind']} heads -> {draft_dir}")
    else:
      log(f"no draft model exported: {no_draft_reason(meta)}")
  finally:
    ckpt.close()
  return Exported(step, out_dir, draft_dir, tokenizer is not None)


def main(argv: Sequence[str] | None = None) -> Exported:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      epilog="OUT_DIR loads with transformers.AutoModelForCausalLM.from_pretrained and"
             " works as policy.path; OUT_DIR/draft/ holds the draft model, if any.")
  parser.add_argument("run_dir", help="a training run directory (holds ckpt/)")
  parser.add_argument("out_dir", help="where to write the HF checkpoint (new or empty)")
  parser.add_argument("--step", type=int, default=None,
                      help="the checkpoint step to export (default: the latest)")
  args = parser.parse_args(argv)
  return export(args.run_dir, args.out_dir, args.step)


if __name__ == "__main__":
  main()
