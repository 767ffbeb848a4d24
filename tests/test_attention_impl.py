"""The attention implementation a run asks for (``policy.attention_impl``): ``auto``
resolved per backend, a backend without the kernels refused before any weight, and the
engine through the Pallas kernels (interpret mode) emitting what the XLA path emits
with every proposer, the sparse draft kernel inside ``self_sparse`` included."""

import grain
import numpy as np
import pytest
from flax import nnx

from spec_rl_jax import checkpoint, train
from spec_rl_jax.config import ConfigError, load_config
from spec_rl_jax.models import attention, eagle3, mtp
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.transformer import init_decoder
from spec_rl_jax.spec.proposers import build_proposer
from spec_rl_jax.spec.proposers.draft_model import DraftModelConfig, DraftModelProposer
from spec_rl_jax.spec.proposers.eagle3 import Eagle3Proposer, Eagle3ProposerConfig
from spec_rl_jax.spec.proposers.mtp import MTPProposer, MTPProposerConfig
from tests import rl_fixtures, spec_fixtures


def test_auto_resolves_per_backend():
  assert attention.resolve_impl("auto", "tpu") == "pallas"
  assert attention.resolve_impl("auto", "gpu") == "xla"  # no Pallas GPU kernel
  assert attention.resolve_impl("auto", "cpu") == "xla"
  assert attention.resolve_impl("auto") == "xla"  # the tests' backend: CPU
  assert attention.resolve_impl("pallas", "tpu") == "pallas"
  for backend in ("tpu", "gpu", "cpu"):
    assert attention.resolve_impl("xla", backend) == "xla"
    assert attention.resolve_impl("pallas_interpret", backend) == "pallas_interpret"


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_pallas_without_a_kernel_is_refused(backend):
  with pytest.raises(ValueError, match=f"not for backend '{backend}'.*'auto' or 'xla'"):
    attention.resolve_impl("pallas", backend)


def test_unknown_impl_is_a_config_error_listing_the_choices():
  with pytest.raises(ConfigError, match=r"policy.attention_impl='triton' is not one of"
                                        r" \['auto', 'pallas', 'pallas_interpret', 'xla'\]"):
    load_config(None, ["policy.attention_impl=triton"])
  with pytest.raises(ValueError, match="choose one of"):
    attention.resolve_impl("triton", "tpu")


def test_trainer_refuses_pallas_on_cpu_before_any_weight(tmp_path, monkeypatch):
  """The error comes before the default models are made (SFT) or a checkpoint is read."""
  def never(*args, **kw):
    raise AssertionError("reached model loading")
  monkeypatch.setattr(train, "ensure_default_models", never)
  monkeypatch.setattr(checkpoint, "load_model", never)
  cfg = load_config(None, [f"run_dir={tmp_path}", "policy.attention_impl=pallas"])
  with pytest.raises(ValueError, match="attention_impl 'pallas'.*backend 'cpu'"):
    train.Trainer(cfg)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
  return rl_fixtures.write_tiny_models(str(tmp_path_factory.mktemp("models")))


def test_load_model_applies_the_impl(tiny_models, tmp_path):
  """HF and native checkpoints come out with the implementation asked for (``auto``:
  CPU's), whatever the checkpoint recorded (a run saves the one it trained with)."""
  run = str(tmp_path / "run")  # a run trained on TPU, with the kernels
  model = init_decoder(get_preset("tiny-qwen3", attention_impl="pallas"), seed=0)
  ckpt = checkpoint.TrainCheckpointer(run)
  ckpt.save(1, {"params": nnx.to_pure_dict(nnx.state(model))},
            iter(grain.MapDataset.range(1).to_iter_dataset()),
            {"model": checkpoint.config_to_json(model.cfg)})
  ckpt.close()
  for path in (tiny_models["policy"], run):
    assert checkpoint.load_model(path)[0].cfg.attention_impl == "xla"
    model, _ = checkpoint.load_model(path, "pallas_interpret")
    assert model.cfg.attention_impl == "pallas_interpret"
    with pytest.raises(ValueError, match="attention_impl 'pallas'"):
      checkpoint.load_model(path, "pallas")


# Where each drafter's model config keeps the implementation its attention runs.
DRAFTER_IMPL = {"draft_model": lambda c: c.attention_impl,
                "eagle3": lambda c: c.layer_config().attention_impl,
                "mtp": lambda c: c.pool_config().attention_impl}


@pytest.mark.parametrize("proposer", sorted(DRAFTER_IMPL))
def test_trainer_applies_the_impl_to_policy_and_drafter(tiny_models, tmp_path, proposer):
  """``policy.attention_impl`` reaches the policy and the drafter loaded for it."""
  cfg = load_config(None, rl_fixtures.tiny_overrides(
      tiny_models, str(tmp_path), **{"policy.attention_impl": "pallas_interpret",
                                     "drafter.proposer": proposer,
                                     "drafter.max_draft_tokens": 2}))
  trainer = train.Trainer(cfg)
  try:
    assert trainer.learner.model().cfg.attention_impl == "pallas_interpret"
    assert DRAFTER_IMPL[proposer](trainer.proposer.model().cfg) == "pallas_interpret"
  finally:
    trainer.close()


# ------------------------------------------------------------------ the engine, per proposer


def _running(model, impl: str):
  """``model`` (the same weights) running attention implementation ``impl``."""
  view = nnx.merge(*nnx.split(model))
  view.cfg = view.cfg.replace(attention_impl=impl)
  return view


# Each proposer built for a policy running some implementation; heads made for a policy
# (Eagle3Config.for_policy, MTPConfig) and the draft model here run the policy's.
PROPOSERS = {
    "draft_model": lambda p: DraftModelProposer(DraftModelConfig(),
                                                _running(p, p.cfg.attention_impl)),
    "ngram": lambda p: build_proposer("ngram", p, max_ngram=3),
    "eagle3": lambda p: Eagle3Proposer(Eagle3ProposerConfig(), eagle3.init_head(
        eagle3.Eagle3Config.for_policy(p.cfg, (1, 1, 1)), seed=5), p),
    "mtp": lambda p: MTPProposer(MTPProposerConfig(),
                                 mtp.init_heads(mtp.MTPConfig(2, p.cfg), seed=5), p),
    # Half the context's 4-9 pages: the sink, the newest page and 0-3 top-k pages
    "self_sparse": lambda p: build_proposer("self_sparse", p, budget=0.5, window=1),
}


REQS = spec_fixtures.GREEDY_REQS[:3]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def rollouts(spec_target):
  """``get(proposer, impl)``: greedy speculative rollouts of `REQS` (K = 2, 3 slots,
  4-token pages), generated once per module."""
  done = {}

  def get(name: str, impl: str):
    if (name, impl) not in done:
      policy = _running(spec_target, impl)
      done[name, impl] = spec_fixtures.engine(
          policy, PROPOSERS[name](policy), 2, 3, page_size=4, max_new_tokens=NEW_TOKENS,
          sampling=spec_fixtures.GREEDY, eos_ids=(11,)).generate(REQS)
    return done[name, impl]
  return get


@pytest.mark.parametrize("name", sorted(PROPOSERS))
def test_engine_through_interpreted_kernels_emits_the_xla_tokens(rollouts, greedy_ar, name):
  """Through the Pallas kernels (interpret mode: the kernels' code on CPU) every
  proposer's greedy rollouts are the XLA path's greedy AR tokens, with its logprobs."""
  got = rollouts(name, "pallas_interpret")
  for want, r in zip(greedy_ar.responses, got.responses):
    assert r.tokens == want.tokens[:NEW_TOKENS]
    np.testing.assert_allclose(r.policy_logprobs, want.policy_logprobs[:NEW_TOKENS],
                               atol=1e-5)
  assert got.metrics["drafted_tokens"] > 0


@pytest.mark.parametrize("name", [
    "self_sparse", *(pytest.param(n, marks=pytest.mark.slow)
                     for n in sorted(PROPOSERS) if n != "self_sparse")])
def test_interpreted_kernels_draft_what_xla_drafts(rollouts, name):
  """Equal acceptance counts with the same verifier mean equal drafts: the draft side's
  kernels (the sparse draft kernel of ``self_sparse``; the draft model's and heads'
  paged attention) agree with the XLA path inside the engine."""
  ref, got = rollouts(name, "xla"), rollouts(name, "pallas_interpret")
  for k in ("drafted_tokens", "accepted_tokens"):
    assert got.metrics[k] == ref.metrics[k], k
  assert [r.tokens for r in got.responses] == [r.tokens for r in ref.responses]
