"""Tokenizer loading: a HF ``tokenizer.json`` through the ``tokenizers`` library.

A checkpoint directory holds ``tokenizer.json`` and optionally
``tokenizer_config.json`` (``eos_token``, ``pad_token``, ``bos_token``,
``chat_template``) and ``generation_config.json`` (``eos_token_id``, int or list). The
project's own task tokenizer is saved in the same format and loads through the same
code, so there is one path for every checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import tokenizers


def _token_str(v) -> str | None:
  """``tokenizer_config.json`` stores special tokens as a string or an AddedToken dict."""
  if v is None or isinstance(v, str):
    return v
  return v.get("content")


@dataclasses.dataclass
class Tokenizer:
  """A ``tokenizers.Tokenizer`` plus the special ids the rollout engine needs."""

  backend: tokenizers.Tokenizer
  eos_ids: tuple[int, ...]
  pad_id: int
  bos_id: int | None = None
  chat_template: str | None = None

  @property
  def vocab_size(self) -> int:
    """Ids in use, added tokens included (the model's vocab may be padded larger)."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_id(self, token: str) -> int:
    i = self.backend.token_to_id(token)
    if i is None:
      raise KeyError(f"token {token!r} is not in the tokenizer vocabulary")
    return i

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    """Loads ``path/tokenizer.json`` (+ configs). ``path`` may be the json file itself."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
      raise FileNotFoundError(f"no tokenizer.json at {file}")
    backend = tokenizers.Tokenizer.from_file(file)
    tcfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    gcfg = _read_json(os.path.join(directory, "generation_config.json"))

    def tid(name):
      tok = _token_str(tcfg.get(name))
      return None if tok is None else backend.token_to_id(tok)

    eos = gcfg.get("eos_token_id", tid("eos_token"))
    if eos is None:
      raise ValueError(f"{directory}: no EOS token (tokenizer_config.json eos_token or"
                       " generation_config.json eos_token_id)")
    eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
    pad = tid("pad_token")
    return cls(backend=backend, eos_ids=eos_ids, pad_id=eos_ids[0] if pad is None else pad,
               bos_id=tid("bos_token"), chat_template=tcfg.get("chat_template"))

  def save(self, directory: str) -> None:
    """Writes ``tokenizer.json`` + ``tokenizer_config.json`` in the HF layout."""
    os.makedirs(directory, exist_ok=True)
    self.backend.save(os.path.join(directory, "tokenizer.json"))
    tok = self.backend.id_to_token
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tok(self.eos_ids[0]), "pad_token": tok(self.pad_id)}
    if self.bos_id is not None:
      tcfg["bos_token"] = tok(self.bos_id)
    if self.chat_template is not None:
      tcfg["chat_template"] = self.chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
      json.dump(tcfg, f, indent=2)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int, what: str = "model") -> None:
  """Raises if the tokenizer can emit ids the model has no embedding for."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
        f"tokenizer has {tokenizer.vocab_size} tokens but the {what} vocab_size is"
        f" {model_vocab_size}: ids >= {model_vocab_size} would index past the embedding."
        " The tokenizer and checkpoint do not belong together.")


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)
