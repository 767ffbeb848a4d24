"""The task tokenizer: lossless on task text, single digits, HF layout, fits the models."""

import pytest
import transformers
from hypothesis import assume, given, settings, strategies as st

from spec_rl_jax.data import SFTEncoder
from spec_rl_jax.models.config import get_preset
from spec_rl_jax.models.tokenizer import Tokenizer, check_vocab
from spec_rl_jax.tasks import TASKS, get_task
from spec_rl_jax.tasks.base import unique_records
from spec_rl_jax.tasks.bpe import (DEFAULT_VOCAB_SIZE, EOS, PAD, default_tokenizer,
                                   train_tokenizer)


@pytest.fixture(scope="module")
def tok():
  return default_tokenizer()


@pytest.mark.parametrize("name", list(TASKS))
def test_round_trips_every_task_string(tok, name):
  for difficulty in ({}, {"arithmetic": {"max_digits": 12, "terms": 5},
                          "countdown": {"num_numbers": 6, "max_number": 999},
                          "counting": {"max_start": 99_999, "min_span": 2, "max_span": 30},
                          "multiplication": {"max_digits": 6, "max_multiplier_digits": 4},
                          }[name]):
    for r in unique_records(get_task(name, **difficulty), "train", 7, 300):
      for text in (r["prompt"], r["answer"], SFTEncoder(tok).template.format(**r)):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.backend.token_to_id(EOS) not in ids


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=50))
def test_round_trips_any_text(tok, text):
  # The special tokens' own spellings encode to the special ids, which decoding skips
  # (as in every HF tokenizer); all other text round-trips.
  assume(EOS not in text and PAD not in text)
  assert tok.decode(tok.encode(text)) == text


def test_digits_are_single_tokens(tok):
  for digits in ["0", "12", "9876543210"]:
    pieces = [tok.backend.id_to_token(i) for i in tok.encode(f"What is {digits}+1?")]
    assert [p for p in pieces if p.isdigit()] == list(digits + "1")


def test_special_tokens_and_hf_layout(tok, tmp_path):
  assert tok.eos_ids == (tok.token_id(EOS),) and tok.pad_id == tok.token_id(PAD)
  assert tok.pad_id != tok.eos_ids[0]
  tok.save(str(tmp_path))
  loaded = Tokenizer.load(str(tmp_path))
  assert loaded.eos_ids == tok.eos_ids and loaded.pad_id == tok.pad_id
  text = "Use 25 19 4 3 to make 27.\n25-19=6. #### (25-19)*4+3"
  assert loaded.encode(text) == tok.encode(text)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf(text, add_special_tokens=False).input_ids == tok.encode(text)
  assert hf.eos_token_id == tok.eos_ids[0] and hf.pad_token_id == tok.pad_id


def test_training_is_deterministic(tok):
  texts = ["What is 12+34?\n2+4=6, 1+3=4. #### 46"] * 20
  a, b = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
  assert a.backend.to_str() == b.backend.to_str()
  assert default_tokenizer().backend.to_str() == tok.backend.to_str()


@pytest.mark.parametrize("preset", ["default-policy", "default-draft"])
def test_vocab_size_matches_the_models(tok, preset):
  cfg = get_preset(preset)
  check_vocab(tok, cfg.vocab_size)
  assert cfg.vocab_size == DEFAULT_VOCAB_SIZE  # the trainer's cap: a retrain cannot exceed it
  assert max(tok.backend.get_vocab().values()) < cfg.vocab_size
  with pytest.raises(ValueError, match="do not belong together"):
    check_vocab(tok, tok.vocab_size - 1)
