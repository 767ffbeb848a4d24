"""The Eagle3 draft head (Li et al., "EAGLE-3", 2025): one decoder layer that drafts from
the policy's own features, laid out as the public ``LlamaForCausalLMEagle3`` checkpoints
of the serving stacks (models/eagle3_io.py reads and writes them).

At token position ``j`` the head reads the token ``t_j`` (through the *policy's*
embedding ``e_j``) and a feature ``g_{j-1}`` of ``D`` values:

  policy features   ``g_{j-1} = fc([f^a_{j-1}; f^b_{j-1}; f^c_{j-1}])``, where ``f^l`` is
                    the input of policy layer ``l`` (the output of layer ``l - 1``) for
                    ``l`` in ``feature_layers`` (the serving stacks' convention; default
                    ``(2, L // 2, L - 3)``); ``g_{-1} = 0`` (position 0 has no feature).
  drafting on       ``g_{j-1} = a_{j-1}``: the head's own output one step back, so draft
                    step ``s`` feeds step ``s - 1``'s output (Eagle3's multi-step draft).

The layer (``midlayer``), with its own KV cache:

  r = g;  u = attn([input_layernorm(e_j); hidden_norm(g)])   (q, k, v read 2D; o writes D)
  r = r + u;  a_j = r + mlp(post_attention_layernorm(r))
  logits_j = lm_head(norm(a_j))   over the draft vocabulary of ``Vd`` tokens

Draft token ``d`` is policy token ``d + d2t[d]`` (``d2t`` holds offsets, as the public
checkpoints do); with ``Vd = V`` the map is the identity. The pair ``(t_j, g_{j-1})``
sits at the head's position ``j - 1`` (RoPE angle and cache row), as in the serving
stacks: token 0 has no pair and no key. A key depends only on its pair, so the cache of
true positions is filled by projections alone (`Eagle3Head.write`), without attention
or MLP.

Shape legend: ``B`` batch (slots), ``T`` tokens, ``D`` embed dim, ``H`` heads, ``Hk`` KV
heads, ``Dh`` head dim, ``V`` policy vocab, ``Vd`` draft vocab, ``h`` feature layers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spec_rl_jax.models import attention
from spec_rl_jax.models.config import AttentionImpl, ModelConfig
from spec_rl_jax.models.layers import (MLP, RMSNorm, _param, apply_rope, project,
                                       rope_inv_freq)
from spec_rl_jax.models.causal_attention import NEG_INF


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
  """The serving stacks' choice: low, middle and high features."""
  return (2, num_layers // 2, num_layers - 3)


def policy_fingerprint(policy: ModelConfig, vocab: dict[str, int] | None) -> str:
  """A short hash of what a head depends on: the policy's architecture and, when known,
  its tokenizer's vocabulary (token -> id)."""
  arch = {f: getattr(policy, f) for f in ("arch", "vocab_size", "embed_dim", "num_layers",
                                          "num_heads", "num_kv_heads", "head_dim")}
  text = json.dumps([arch, sorted(vocab.items()) if vocab is not None else None])
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_made_for(what: str, side: str, pairs: dict[str, tuple[Any, Any]],
                   recorded: str, fingerprint: str | None) -> None:
  """Raises unless each ``pairs[name] = (heads' value, policy's value)`` agrees and, when
  both are known, the ``recorded`` fingerprint is the policy's ``fingerprint``
  (``what``: e.g. "the Eagle3 head", ``side``: how the message names the heads)."""
  bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
  if bad:
    raise ValueError(f"{what} was trained for another policy: " + ", ".join(
        f"{k} {a} ({side}) vs {b} (policy)" for k, (a, b) in bad.items()))
  if recorded and fingerprint and recorded != fingerprint:
    raise ValueError(f"{what} was trained for policy fingerprint {recorded}, this"
                     f" policy's is {fingerprint} (another tokenizer or architecture)")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """The head's hyper-parameters and the policy it reads (``policy_layers``: its ``L``;
  ``policy_fingerprint``: `policy_fingerprint` of the policy it was trained for, ``""``
  when unknown)."""

  vocab_size: int  # V: the policy's vocabulary
  draft_vocab_size: int  # Vd
  embed_dim: int  # D: the policy's hidden size
  mlp_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  policy_layers: int
  feature_layers: tuple[int, ...]
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  max_position_embeddings: int = 4096
  param_dtype: str = "float32"
  policy_fingerprint: str = ""
  attention_impl: AttentionImpl = "xla"  # the policy's (a runtime choice, not exported)

  def __post_init__(self):
    object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
    if len(self.feature_layers) != 3:
      raise ValueError(f"Eagle3 fuses 3 feature layers, got {self.feature_layers}")
    bad = [l for l in self.feature_layers if not 1 <= l < self.policy_layers]
    if bad:
      raise ValueError(f"Eagle3 feature layers {bad} out of range: a feature is the input"
                       f" of policy layer l, 1 <= l < {self.policy_layers}")
    if not 0 < self.draft_vocab_size <= self.vocab_size:
      raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in"
                       f" [1, vocab_size={self.vocab_size}]")
    self.layer_config()  # validates heads, head_dim and dtype

  @classmethod
  def for_policy(cls, policy: ModelConfig, feature_layers: tuple[int, ...] = (),
                 draft_vocab_size: int | None = None, mlp_dim: int | None = None,
                 fingerprint: str = "") -> "Eagle3Config":
    """A head shaped like one layer of ``policy`` (attention without q/k norms, as the
    public heads are Llama layers)."""
    return cls(vocab_size=policy.vocab_size,
               draft_vocab_size=draft_vocab_size or policy.vocab_size,
               embed_dim=policy.embed_dim, mlp_dim=mlp_dim or policy.mlp_dim,
               num_heads=policy.num_heads, num_kv_heads=policy.num_kv_heads,
               head_dim=policy.head_dim, policy_layers=policy.num_layers,
               feature_layers=feature_layers or default_feature_layers(policy.num_layers),
               rope_theta=policy.rope_theta, norm_eps=policy.norm_eps,
               max_position_embeddings=policy.max_position_embeddings,
               param_dtype=policy.param_dtype, policy_fingerprint=fingerprint,
               attention_impl=policy.attention_impl)

  def layer_config(self) -> ModelConfig:
    """The midlayer as a one-layer `ModelConfig` (its KV cache, MLP and RoPE)."""
    return ModelConfig(arch="llama", vocab_size=self.draft_vocab_size,
                       embed_dim=self.embed_dim, mlp_dim=self.mlp_dim, num_layers=1,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, rope_theta=self.rope_theta,
                       norm_eps=self.norm_eps,
                       max_position_embeddings=self.max_position_embeddings,
                       param_dtype=self.param_dtype, attention_impl=self.attention_impl)

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """The policy layers whose *outputs* are the features (``feature_layers - 1``)."""
    return tuple(l - 1 for l in self.feature_layers)

  def check_policy(self, policy: ModelConfig, fingerprint: str | None = None) -> None:
    """Raises unless this head was made for ``policy`` (and, when both are known, the
    policy with ``fingerprint``)."""
    check_made_for("the Eagle3 head", "head",
                   {"hidden size": (self.embed_dim, policy.embed_dim),
                    "layer count": (self.policy_layers, policy.num_layers),
                    "vocabulary": (self.vocab_size, policy.vocab_size)},
                   self.policy_fingerprint, fingerprint)


class DraftVocab(nnx.Variable):
  """``d2t [Vd]`` offsets (not trained)."""


class Eagle3Layer(nnx.Module):
  """``midlayer``: a Llama decoder layer whose attention reads ``[norm(e); norm(g)]``."""

  def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs):
    D, H, K, Dh = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lc = cfg.layer_config()
    dt = lc.dtype
    self.input_layernorm = RMSNorm(D, cfg.norm_eps, dtype=dt)
    self.hidden_norm = RMSNorm(D, cfg.norm_eps, dtype=dt)
    self.q = _param(rngs, (), (H, Dh, 2 * D), ("heads", "head_dim", "embed"), dt, in_dims=1)
    self.k = _param(rngs, (), (K, Dh, 2 * D), ("kv_heads", "head_dim", "embed"), dt,
                    in_dims=1)
    self.v = _param(rngs, (), (K, Dh, 2 * D), ("kv_heads", "head_dim", "embed"), dt,
                    in_dims=1)
    self.o = _param(rngs, (), (D, H, Dh), ("embed", "heads", "head_dim"), dt, in_dims=2)
    self.post_attention_layernorm = RMSNorm(D, cfg.norm_eps, dtype=dt)
    self.mlp = MLP(lc, rngs=rngs)
    self.layer_cfg = lc

  def qkv(self, e, g, positions):
    """``q [B,T,H,Dh]``, ``k, v [B,T,Hk,Dh]`` of ``(e, g) [B,T,D]`` at ``positions``."""
    x = jnp.concatenate([self.input_layernorm(e), self.hidden_norm(g)], -1)  # [B, T, 2D]
    inv_freq = rope_inv_freq(self.layer_cfg)
    q = apply_rope(project(x, self.q), positions, inv_freq)
    k = apply_rope(project(x, self.k), positions, inv_freq)
    return q, k, project(x, self.v)

  def finish(self, g, attn_out):
    """``a = r + mlp(norm(r))`` with ``r = g + o(attn_out [B,T,H,Dh])``."""
    B, T, H, Dh = attn_out.shape
    r = g + project(attn_out.astype(g.dtype).reshape(B, T, H * Dh), self.o)
    return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(nnx.Module):
  """``fc`` → ``midlayer`` → ``norm`` → ``lm_head``, and the ``d2t`` map."""

  def __init__(self, cfg: Eagle3Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    D, dt = cfg.embed_dim, cfg.layer_config().dtype
    self.fc = _param(rngs, (), (D, 3 * D), ("embed", None), dt, in_dims=1)
    self.midlayer = Eagle3Layer(cfg, rngs=rngs)
    self.norm = RMSNorm(D, cfg.norm_eps, dtype=dt)
    self.lm_head = _param(rngs, (), (cfg.draft_vocab_size, D), ("vocab", "embed"), dt)
    self.d2t = DraftVocab(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

  def fuse(self, hidden: jax.Array) -> jax.Array:
    """Policy features ``hidden [3, B, T, D]`` (outputs of ``cfg.hidden_layers``) →
    ``g [B, T, D]``."""
    return project(jnp.concatenate(list(hidden), -1).astype(self.fc.dtype), self.fc)

  def __call__(self, e, g, positions, cache):
    """One layer over ``e, g [B,T,D]`` at ``positions [B,T]`` with the attention context
    ``cache`` (models/attention.py; its ``layers`` have one layer) → ``(a [B,T,D],
    cache)``."""
    q, k, v = self.midlayer.qkv(e, g, positions)
    impl = attention.get_impl(self.cfg.layer_config().attention_impl)
    out, layers = cache.attend(impl, cache.layers, 0, q, k, v, positions)
    return self.midlayer.finish(g, out), cache.replace(layers=layers)

  def write(self, e, g, positions, cache):
    """Writes the keys and values of ``(e, g)`` at ``positions`` into ``cache`` (a paged
    cache) without attending: the cache of positions whose features are the policy's."""
    _, k, v = self.midlayer.qkv(e, g, positions)
    q = jnp.zeros(k.shape[:2] + (self.cfg.num_heads, self.cfg.head_dim), k.dtype)
    _, layers = cache.attend(_NO_ATTENTION, cache.layers, 0, q, k, v, positions)
    return cache.replace(layers=layers)

  def logits(self, a: jax.Array) -> jax.Array:
    """``a [..., D]`` → fp32 draft-vocabulary logits ``[..., Vd]``."""
    return jnp.einsum("...d,vd->...v", self.norm(a), self.lm_head[...],
                      preferred_element_type=jnp.float32)

  def target_ids(self) -> jax.Array:
    """``[Vd]`` policy token id of each draft token."""
    return jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32) + self.d2t[...]

  def policy_logits(self, a: jax.Array) -> jax.Array:
    """``a [..., D]`` → ``[..., V]`` logits over the policy's vocabulary (tokens outside
    the draft vocabulary at ``-inf``: never drafted)."""
    lg = self.logits(a)
    full = jnp.full(lg.shape[:-1] + (self.cfg.vocab_size,), NEG_INF, lg.dtype)
    return full.at[..., self.target_ids()].set(lg)


def _skip_paged(q, k_pages, v_pages, page_table, kv_lens):
  del k_pages, v_pages, page_table, kv_lens
  return q


# A paged "attention" that only lets the cache write its keys and values.
_NO_ATTENTION = attention.AttentionImpl(dense=None, causal=None, paged=_skip_paged,
                                        sparse=None)


def init_head(cfg: Eagle3Config, seed: int = 0) -> Eagle3Head:
  return Eagle3Head(cfg, rngs=nnx.Rngs(seed))


def abstract_head(cfg: Eagle3Config) -> Eagle3Head:
  return nnx.eval_shape(lambda: Eagle3Head(cfg, rngs=nnx.Rngs(0)))


def embed(policy_weights: Any, graphdef: nnx.GraphDef, tokens: jax.Array) -> jax.Array:
  """The policy's token embedding of ``tokens`` (``policy_weights``: its
  `transformer.Weights`)."""
  table = nnx.merge(graphdef, policy_weights.state).embed[...]
  return jnp.take(table, tokens, axis=0)


def _shift(x: jax.Array, n: int = 1) -> jax.Array:
  """``x[:, j - n]`` at ``j`` along axis 1 (zeros for ``j < n``)."""
  return jnp.pad(x, ((0, 0), (n, 0)) + ((0, 0),) * (x.ndim - 2))[:, :x.shape[1]]


def training_time_test(head: Eagle3Head, e: jax.Array, hidden: jax.Array, valid: jax.Array,
                       steps: int) -> jax.Array:
  """Eagle3's training-time test: the draft-vocabulary logits ``[steps, B, T, Vd]`` that
  drafting computes, for every chain start at once (teacher forcing, no cache).

  ``e [B, T, D]``: the policy's embeddings of the tokens; ``hidden [3, B, T, D]``: the
  policy's features (outputs of ``cfg.hidden_layers``); ``valid [B, T]``: real tokens
  (right padding). Row ``s`` at token ``j`` is draft step ``s`` of the round that
  started at ``p = j - s`` with the tokens ``t_{p..j}``: step 0 reads the policy's feature
  ``g_{j-1}``, step ``s`` the step ``s - 1`` output ``a^{s-1}_{j-1}``; its query sees the
  keys of step 0 for tokens ``1..p`` and of steps ``r = 1..s`` for ``p + r`` (the cache
  at drafting time). It predicts ``t_{j+1}`` (meaningful for ``1 <= j``, ``s <= j``).
  """
  B, T, D = e.shape
  Hk, Dh = head.cfg.num_kv_heads, head.cfg.head_dim
  G = head.cfg.num_heads // Hk
  positions = jnp.broadcast_to(jnp.arange(T) - 1, (B, T))  # token j's pair at j - 1
  g = _shift(head.fuse(hidden))
  idx = jnp.arange(T)
  # Step-0 keys of tokens 1..j (token 0 has no pair), real ones only.
  mask0 = ((idx[None, :, None] >= idx[None, None, :]) & (idx[None, None, :] >= 1)
           & valid[:, None, :])  # [B, Tq, Tk]
  keys, values, outs = [], [], []
  for s in range(steps):
    q, k, v = head.midlayer.qkv(e, g, positions)
    keys.append(k)
    values.append(v)
    qg = q.reshape(B, T, Hk, G, Dh).astype(jnp.float32) * Dh ** -0.5
    s0 = jnp.einsum("btkgd,bukd->bkgtu", qg, keys[0].astype(jnp.float32))  # [B,Hk,G,T,T]
    m = (mask0 & (idx[None, None, :] <= idx[None, :, None] - s))[:, None, None]
    s0 = jnp.where(m, s0, NEG_INF)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, _shift(keys[r], s - r).astype(jnp.float32))
            for r in range(1, s + 1)]  # the chain's own keys, one per step
    logits = jnp.concatenate([s0] + [d[..., None] for d in diag], -1)
    probs = jax.nn.softmax(logits, -1)
    out = jnp.einsum("bkgtu,bukd->btkgd", probs[..., :T], values[0].astype(jnp.float32))
    for r in range(1, s + 1):
      out += probs[..., T + r - 1].transpose(0, 3, 1, 2)[..., None] * _shift(
          values[r], s - r).astype(jnp.float32)[:, :, :, None]
    a = head.midlayer.finish(g, out.reshape(B, T, head.cfg.num_heads, Dh))
    outs.append(head.logits(a))
    g = _shift(a)
  return jnp.stack(outs)
