"""The ``mtp`` proposer and its heads (models/mtp.py): the drafts' logits and the rows
equal the teacher-forced forward on the true tokens (whatever the rounds accepted),
heads that copy a one-layer policy draft it exactly, greedy and sampled speculative
rollouts are exact, checkpoints round-trip under DeepSeek-V3's names, bad ones are
refused, and the distillation loss matches a hand computation."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx
from safetensors.numpy import load_file, save_file

from spec_rl_jax.models import attention, mtp
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.eagle3 import policy_fingerprint
from spec_rl_jax.models.tokenizer import Tokenizer
from spec_rl_jax.models.transformer import (Weights, abstract_decoder, init_decoder,
                                             teacher_forced)
from spec_rl_jax.rollout.engine import RolloutEngine
from spec_rl_jax.rollout.types import EngineConfig
from spec_rl_jax.sampling import SamplingParams
from spec_rl_jax.spec import verifier
from spec_rl_jax.spec.proposers import DraftContext, Feedback, PrefillBatch, build_proposer
from spec_rl_jax.spec.proposers.mtp import MTPProposer, MTPProposerConfig
from tests import spec_fixtures
from tests import test_spec_exactness as exactness

V = 16
CFG = get_preset("tiny-qwen3", vocab_size=V)  # 2 layers
DM = 3  # D_m
# Samples per exactness case: fewer than test_spec_exactness's 20k (the default tier's
# time); the chi-square and TV thresholds are for the sample size.
N_SAMPLES = 8_000


def _scaled(module, scale):
  """``module`` with its parameters times ``scale`` (peaked distributions)."""
  nnx.update(module, jax.tree.map(lambda x: scale * x, nnx.state(module, nnx.Param)))
  return module


def _heads(policy_cfg, num_modules=DM, seed=0, scale=4.0, fingerprint=""):
  return _scaled(mtp.init_heads(mtp.MTPConfig(num_modules, policy_cfg, fingerprint), seed),
                 scale)


@pytest.fixture(scope="module")
def policy():
  return _scaled(init_decoder(CFG, seed=3), 4.0)


# --------------------------------------------------------------------------- the cache


def test_drafts_and_rows_equal_teacher_forcing(policy):
  """Rounds of hand-built verification results (all accepted, none, some; a slot idle):
  every draft ``q_d`` conditioned on true tokens equals module ``d``'s teacher-forced
  distribution at ``ℓ + d - 1``, and the rows are the teacher-forced features at the
  last position before ``ℓ``."""
  heads = _heads(CFG)
  prop = MTPProposer(MTPProposerConfig(), heads, policy)
  pgd, pstate = nnx.split(policy)
  pw, hw = Weights(pstate, None), Weights(nnx.state(heads), None)
  S, K, Ps, Tmax = 2, 3, 4, 40
  ec = EngineConfig(num_slots=S, page_size=Ps, num_pages=32, max_seq_len=64,
                    max_new_tokens=32, max_draft_tokens=K)
  state = prop.init_state(ec)
  pages = jnp.arange(S * 16).reshape(S, 16)
  sampling = SamplingParams(temperature=1.0)
  L = CFG.num_layers
  policy_tf = jax.jit(lambda t, valid: teacher_forced(pgd, pstate, t, valid, (L - 1,)))

  # Prefill: prompts of 5 and 3 tokens, left-padded to 6.
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, V, 5).tolist(), rng.integers(1, V, 3).tolist()]
  T = 6
  lens = np.asarray([len(s) for s in seqs])
  tokens = jnp.asarray([[0] * (T - len(s)) + s for s in seqs], jnp.int32)
  positions = jnp.asarray(lens[:, None] - T + np.arange(T)[None], jnp.int32)
  hidden = policy(tokens, positions, cache=attention.NoCache(valid=positions >= 0),
                  hidden_layers=(L - 1,)).hidden
  state = jax.jit(prop.prefill)(hw, state, PrefillBatch(jnp.arange(S), tokens, positions,
                                                        pages, hidden, pw))
  for s in seqs:  # the first sampled token: the newest, at position ℓ
    s.append(int(rng.integers(1, V)))

  def padded():
    toks = np.zeros((S, Tmax), np.int32)
    for i, s in enumerate(seqs):
      toks[i, :len(s)] = s
    return jnp.asarray(toks), jnp.asarray(np.arange(Tmax)[None] < np.asarray(
        [len(s) for s in seqs])[:, None])

  propose = jax.jit(prop.propose, static_argnums=(3, 4))
  observe = jax.jit(prop.observe)
  checks = []  # (slot, ℓ, d, q_d)
  # n per round and slot: all accepted, none, some, idle (0).
  for r, emit in enumerate([(4, 1), (1, 0), (2, 4), (3, 2), (4, 3)]):
    length = np.asarray([len(s) - 1 for s in seqs])
    active = jnp.asarray([n > 0 for n in emit])
    ctx = DraftContext(
        last=jnp.asarray([s[-1] for s in seqs]), length=jnp.asarray(length), active=active,
        rid=jnp.arange(S), group=jnp.arange(S), history=padded()[0], page_table=pages,
        key=jax.random.key(r), temperature=jnp.ones((S,)), target_weights=pw, cache=None)
    drafts, q, state = propose(hw, state, ctx, K, sampling)
    drafts = np.asarray(drafts)
    out = np.zeros((S, K + 1), np.int32)
    for i, n in enumerate(emit):
      checks += [(i, int(length[i]), d, q[i, d - 1]) for d in range(1, min(n, K) + 1)]
      if n:  # drafts 1..n-1 accepted, then a correction (or the bonus) token
        corr = (int(drafts[i, n - 1]) + 1) % V if n <= K else int(rng.integers(V))
        out[i, :n] = list(drafts[i, :n - 1]) + [corr]
        seqs[i] += out[i, :n].tolist()
    inputs = jnp.concatenate([ctx.last[:, None], jnp.asarray(drafts)], 1)
    pos = jnp.where(active[:, None], ctx.length[:, None] + jnp.arange(K + 1), -1)
    # h^0 at ℓ + i from the true tokens (only i < n is read as true).
    h_all = policy_tf(*padded()).hidden  # [1, S, Tmax, D]
    idx = jnp.clip(ctx.length[:, None] + jnp.arange(K + 1), 0, Tmax - 1)
    hid = jnp.take_along_axis(h_all, idx[None, :, :, None], axis=2)
    state = observe(hw, state, Feedback(inputs, pos, jnp.asarray(out), jnp.asarray(emit),
                                        hid, pages, pw))

  toks, valid = padded()
  h0 = policy_tf(toks, valid).hidden[0]
  tables = mtp.policy_tables(pgd, pstate)
  lp = jax.nn.log_softmax(mtp.forward(heads, tables, toks, h0, valid))  # [D_m, S, Tmax, V]
  assert len(checks) == 21
  for i, length, d, qd in checks:
    np.testing.assert_allclose(qd, lp[d - 1, i, length + d - 1], atol=2e-4,
                               err_msg=f"slot {i}, ℓ {length}, draft {d}")

  e = jnp.take(tables.embed, toks, axis=0)
  h, _ = heads.chain(e, h0, jnp.zeros((DM, S, CFG.embed_dim)),
                     jnp.broadcast_to(jnp.arange(Tmax), toks.shape),
                     attention.NoCache(valid=valid))
  feats = jnp.concatenate([h0[None], h[:-1]], 0)  # [D_m, S, Tmax, D]
  for i, s in enumerate(seqs):
    np.testing.assert_allclose(state.rows["h"][i], feats[:, i, len(s) - 2], atol=2e-4)


# --------------------------------------------------------------------------- engine


def _copying_heads(policy, num_modules=DM):
  """Heads whose every module is the one-layer ``policy``: ``eh_proj = [I, 0]`` passes
  the embedding (unit RMS rows: ``enorm`` keeps it), the block is the policy's layer,
  ``head_norm`` its final norm. Every module then predicts ``t_{j+1}`` exactly as the
  policy does, from its own cache of the tokens — so only a right cache drafts right."""
  D = policy.cfg.embed_dim
  heads = mtp.init_heads(mtp.MTPConfig(num_modules, policy.cfg))
  stack = lambda x: jnp.broadcast_to(x, (num_modules,) + x.shape[1:])
  nnx.update(heads.layers.block, jax.tree.map(stack, nnx.state(policy.layers, nnx.Param)))
  heads.layers.eh_proj[...] = stack(jnp.eye(D, 2 * D)[None])
  heads.layers.head_norm.scale[...] = stack(policy.final_norm.scale[...][None])
  return heads


@pytest.fixture(scope="module")
def one_layer_policy():
  model = _scaled(init_decoder(get_preset("tiny-qwen3", vocab_size=spec_fixtures.V,
                                          num_layers=1), seed=5), 4.0)
  e = model.embed[...]
  model.embed[...] = e * jax.lax.rsqrt(jnp.mean(e * e, -1, keepdims=True))
  return model


@pytest.mark.slow
def test_copying_heads_draft_the_policy(one_layer_policy):
  """Greedy SD with heads that copy a one-layer policy accepts every draft: K = D_m, so
  every module drafts over its window, and every round is all-accepted (the newest
  token's keys are written by the next round)."""
  policy = one_layer_policy
  prop = MTPProposer(MTPProposerConfig(), _copying_heads(policy), policy)
  sd = spec_fixtures.engine(policy, prop, DM, 4, sampling=spec_fixtures.GREEDY,
                            eos_ids=(11,)).generate(spec_fixtures.GREEDY_REQS[:4])
  m = sd.metrics
  assert m["accepted_tokens"] >= 0.98 * m["drafted_tokens"] > 0, m


@pytest.mark.parametrize("K", [2, pytest.param(1, marks=pytest.mark.slow),
                               pytest.param(3, marks=pytest.mark.slow)])
def test_greedy_sd_equals_greedy_ar(spec_target, greedy_ar, K):
  prop = MTPProposer(MTPProposerConfig(), _heads(spec_target.cfg, scale=1.0), spec_target)
  sd = spec_fixtures.engine(spec_target, prop, K, 4, sampling=spec_fixtures.GREEDY,
                            eos_ids=(11,)).generate(spec_fixtures.GREEDY_REQS)
  assert [r.tokens for r in sd.responses] == [r.tokens for r in greedy_ar.responses]
  for a, b in zip(greedy_ar.responses, sd.responses):
    assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=1e-4)
  m = sd.metrics
  assert m["drafted_tokens"] == K * m["slot_rounds"] > 0
  assert m["rounds_at_k"] == {K: m["rounds"]}


def _exactness_proposer(target):
  return MTPProposer(MTPProposerConfig(), _heads(target.cfg, num_modules=2, seed=4), target)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    pytest.param(1.0, 0, 1.0, marks=pytest.mark.slow),
    pytest.param(1.0, 0, 0.9, marks=pytest.mark.slow),
    pytest.param(0.7, 3, 1.0, marks=pytest.mark.slow)])
def test_sampled_sd_is_exact(temperature, top_k, top_p):
  target = exactness._target()
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
  res = exactness._sample(target, _exactness_proposer(target), params, n=N_SAMPLES)
  fit = exactness._fit(target, params, res)
  assert fit["chi2"] < fit["chi2_max"] and fit["tv"] < fit["tv_max"], fit
  m = res.metrics
  assert 0 < m["accepted_tokens"] < m["drafted_tokens"]


@pytest.mark.slow
def test_broken_sampler_is_detected(monkeypatch):
  """The control: the exactness test above fails a sampler without the residual."""
  monkeypatch.setattr(verifier, "residual_distribution", lambda p, q: p)
  target = exactness._target()
  params = SamplingParams(temperature=1.0)
  res = exactness._sample(target, _exactness_proposer(target), params, n=N_SAMPLES)
  fit = exactness._fit(target, params, res)
  assert fit["chi2"] > fit["chi2_max"] and fit["tv"] > fit["tv_max"], fit


def test_more_drafts_than_modules_are_refused(policy):
  prop = MTPProposer(MTPProposerConfig(), _heads(CFG, num_modules=2), policy)
  with pytest.raises(ValueError, match="drafts at most 2 tokens per round; max_draft_tokens"
                                       " is 3"):
    RolloutEngine(policy, EngineConfig(num_slots=2, page_size=8, num_pages=16, max_seq_len=32,
                                       max_new_tokens=8, max_draft_tokens=3), proposer=prop)


# --------------------------------------------------------------------------- checkpoints


def test_save_load_round_trip_under_deepseek_names(policy, tmp_path):
  heads = _heads(CFG, seed=7)
  mtp.save_mtp(heads, str(tmp_path))
  tensors = load_file(str(tmp_path / mtp.WEIGHTS_FILE))
  L, D, H, Dh = CFG.num_layers, CFG.embed_dim, CFG.num_heads, CFG.head_dim
  per_module = {"enorm.weight": (D,), "hnorm.weight": (D,), "eh_proj.weight": (D, 2 * D),
                "shared_head.norm.weight": (D,), "input_layernorm.weight": (D,),
                "post_attention_layernorm.weight": (D,),
                "self_attn.q_proj.weight": (H * Dh, D), "self_attn.o_proj.weight": (D, H * Dh),
                "self_attn.k_proj.weight": (CFG.num_kv_heads * Dh, D),
                "self_attn.v_proj.weight": (CFG.num_kv_heads * Dh, D),
                "self_attn.q_norm.weight": (Dh,), "self_attn.k_norm.weight": (Dh,),
                "mlp.gate_proj.weight": (CFG.mlp_dim, D), "mlp.up_proj.weight": (CFG.mlp_dim, D),
                "mlp.down_proj.weight": (D, CFG.mlp_dim)}
  assert {n: t.shape for n, t in tensors.items()} == {
      f"model.layers.{L + d}.{name}": shape for d in range(DM)
      for name, shape in per_module.items()}
  np.testing.assert_array_equal(tensors[f"model.layers.{L + 1}.eh_proj.weight"],
                                heads.layers.eh_proj[1])
  with open(tmp_path / mtp.CONFIG_FILE) as f:
    hf = json.load(f)
  assert hf["num_nextn_predict_layers"] == DM and hf["num_hidden_layers"] == L

  loaded = mtp.load_mtp(str(tmp_path))
  assert loaded.cfg == heads.cfg
  jax.tree.map(np.testing.assert_array_equal, nnx.state(loaded), nnx.state(heads))
  prop = build_proposer("mtp", policy, path=str(tmp_path))
  assert prop.hidden_layers == (L - 1,)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(prop.model()), nnx.state(heads))


def _rewrite(directory, edit):
  path = os.path.join(directory, mtp.WEIGHTS_FILE)
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path)


def test_bad_checkpoints_are_refused(policy, tmp_path):
  d = str(tmp_path)
  mtp.save_mtp(_heads(CFG), d)
  other = abstract_decoder(get_preset("tiny-qwen3", vocab_size=V, num_layers=3))
  with pytest.raises(ValueError, match="layer count 2 .heads. vs 3"):
    build_proposer("mtp", other, path=d)
  with pytest.raises(ValueError, match="hidden size"):
    MTPProposer(MTPProposerConfig(), _heads(CFG.replace(embed_dim=32)), policy)
  with pytest.raises(ValueError, match="dtype bfloat16 .heads. vs float32"):
    MTPProposer(MTPProposerConfig(), _heads(CFG.replace(param_dtype="bfloat16")), policy)
  name = "model.layers.3.self_attn.k_proj.weight"
  _rewrite(d, lambda t: t.__setitem__(name, t[name][:-1]))
  with pytest.raises(ValueError, match=f"{name}.*shape"):
    mtp.load_mtp(d)
  _rewrite(d, lambda t: t.pop("model.layers.2.hnorm.weight"))
  with pytest.raises(ValueError, match="model.layers.2.hnorm.weight' missing"):
    mtp.load_mtp(d)


def test_heads_for_another_tokenizer_are_refused(policy, tmp_path):
  def tok(words):
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token=words[0]))
    return Tokenizer(backend=backend, eos_ids=(0,), pad_id=0)

  words = [f"t{i}" for i in range(V)]
  mine = tok(words)
  heads = _heads(CFG, fingerprint=policy_fingerprint(CFG, mine.backend.get_vocab()))
  mtp.save_mtp(heads, str(tmp_path))
  build_proposer("mtp", policy, mine, path=str(tmp_path))  # its own policy: accepted
  with pytest.raises(ValueError, match="fingerprint"):
    build_proposer("mtp", policy, tok(words[::-1]), path=str(tmp_path))


# --------------------------------------------------------------------------- training


def test_distill_loss_by_hand():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 2, 3, 5)).astype(np.float32) * 2  # [D_m, B, T, V]
  teacher = rng.normal(size=(2, 3, 5)).astype(np.float32) * 2
  teacher[0, 0] = logits[0, 0, 0] + 1.0  # module 1 agrees with the teacher there
  mask = np.asarray([[0, 1, 1], [1, 1, 0]], np.float32)
  loss, metrics = jax.jit(mtp.distill_loss)(logits, teacher, mask / mask.sum())

  def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  logp, logq = log_softmax(teacher), log_softmax(logits)
  kl = (np.exp(logp)[None] * (logp[None] - logq)).sum(-1)  # [D_m, B, T]
  per_module = (kl * mask).sum((1, 2)) / mask.sum()
  acc = ((logits.argmax(-1) == teacher.argmax(-1)[None]) * mask).sum((1, 2)) / mask.sum()
  np.testing.assert_allclose(metrics["kl"], per_module, rtol=1e-5)
  np.testing.assert_allclose(loss, per_module.mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["accuracy"], acc)
  # The gradient reaches the heads, never the teacher.
  g_student, g_teacher = jax.grad(lambda s, t: mtp.distill_loss(s, t, mask / mask.sum())[0],
                                  argnums=(0, 1))(jnp.asarray(logits), jnp.asarray(teacher))
  assert np.abs(g_student).sum() > 0 and not np.any(g_teacher)


def test_forward_trains_the_heads(policy):
  """A few distillation steps on the policy's own sequences lower the loss (the
  teacher-forced forward is differentiable end to end)."""
  L = CFG.num_layers
  heads = _heads(CFG, scale=1.0)
  pgd, pstate = nnx.split(policy)
  tables = mtp.policy_tables(pgd, pstate)
  rng = np.random.default_rng(2)
  toks = jnp.asarray(rng.integers(1, V, (4, 12)), jnp.int32)
  valid = jnp.ones(toks.shape, bool)
  out = teacher_forced(pgd, pstate, toks, valid, (L - 1,))
  gd, params = nnx.split(heads)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(params):
    def loss_fn(p):
      logits = mtp.forward(nnx.merge(gd, p), tables, toks, out.hidden[0], valid)
      return mtp.distill_loss(logits, out.logits, valid / valid.sum())[0]
    loss, g = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, g), loss

  params, first = step(params)
  for _ in range(5):
    params, loss = step(params)
  assert loss < first
