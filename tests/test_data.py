"""Data pipelines: sources, JSONL errors, SFT batches and their loss mask, iterator state."""

import json
import logging

import numpy as np
import pytest

from spec_rl_jax.rl.prompts import prompt_stream
from spec_rl_jax.data import (JsonlError, Source, SFTEncoder, in_held_out, read_jsonl,
                              sft_batches)
from spec_rl_jax.tasks import get_task
from spec_rl_jax.tasks.base import export_jsonl
from spec_rl_jax.tasks.bpe import default_tokenizer


@pytest.fixture(scope="module")
def tok():
  return default_tokenizer()


def test_source_parse():
  s = Source.parse("task:countdown?num_numbers=4,max_number=30@0.5")
  assert s == Source("task", "countdown", (("num_numbers", 4), ("max_number", 30)), 0.5)
  assert Source.parse("jsonl:/tmp/a.jsonl") == Source("jsonl", "/tmp/a.jsonl")
  assert s.describe() == {"num_numbers": 4, "max_number": 30, "max_target": 50,
                          "name": "countdown"}
  for bad in ["countdown", "parquet:/x", "task:", "task:countdown?num_numbers",
              "task:countdown?num_numbers=four"]:
    with pytest.raises(ValueError, match="bad"):
      Source.parse(bad)


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_jsonl_bad_lines_raise_with_line_number_or_are_skipped(tmp_path, caplog):
  good = json.dumps({"prompt": "What is 1+1?", "answer": "#### 2"})
  path = _write(tmp_path / "d.jsonl", [good, "", "{not json", json.dumps({"prompt": "x"}),
                                       json.dumps([1, 2]), good])
  with pytest.raises(JsonlError, match=r"d\.jsonl:3: "):
    read_jsonl(path)
  with caplog.at_level(logging.WARNING):
    records = read_jsonl(path, skip_bad_lines=True)
  assert records == [json.loads(good)] * 2
  assert "skipped 3 bad line(s): [3, 4, 5]" in caplog.text
  with pytest.raises(JsonlError, match=r":1: field 'answer'"):
    read_jsonl(_write(tmp_path / "e.jsonl", [json.dumps({"prompt": "p", "answer": 3})]))
  with pytest.raises(JsonlError, match="no records"):
    read_jsonl(_write(tmp_path / "f.jsonl", [""]))


def test_sft_batch_layout_and_loss_mask(tok):
  src = [Source.parse("task:arithmetic?max_digits=3")]
  batch = next(iter(sft_batches(src, tok, batch_size=4, max_len=48, seed=0)))
  assert {k: v.shape for k, v in batch.items()} == {k: (4, 48) for k in batch}
  record = src[0].records("train", 0)[0]
  ex = SFTEncoder(tok)(record)
  n = len(ex["ids"]) - 1
  row = {k: v[0] for k, v in batch.items()}
  np.testing.assert_array_equal(row["tokens"][:n], ex["ids"][:-1])
  np.testing.assert_array_equal(row["targets"][:n], ex["ids"][1:])
  assert row["valid"].sum() == n and not row["valid"][n:].any()
  # The loss covers exactly the response tokens and the final EOS.
  target_text = tok.decode(row["targets"][row["loss_mask"] > 0], skip_special_tokens=False)
  assert target_text == record["answer"] + "<|endoftext|>"


def test_overlong_examples_are_dropped(tok, caplog):
  src = [Source.parse("task:arithmetic?min_digits=1,max_digits=6")]
  with caplog.at_level(logging.WARNING):
    batch = next(iter(sft_batches(src, tok, batch_size=16, max_len=40, seed=0)))
  assert batch["valid"].sum(1).max() <= 40 and batch["loss_mask"].sum(1).min() > 0
  assert "longer than max_len=40" in caplog.text


def test_iterator_state_restores_the_same_future(tok, tmp_path):
  path = tmp_path / "a.jsonl"
  export_jsonl(get_task("countdown"), str(path), "train", 30)
  src = [Source.parse("task:arithmetic@2"), Source.parse(f"jsonl:{path}")]
  it = iter(sft_batches(src, tok, batch_size=8, max_len=64, seed=1, pad_multiple=16))
  for _ in range(5):  # past one epoch of the file: reshuffled repeats
    next(it)
  state = it.get_state()
  future = [next(it) for _ in range(3)]
  fresh = iter(sft_batches(src, tok, batch_size=8, max_len=64, seed=1, pad_multiple=16))
  fresh.set_state(state)
  for a, b in zip(future, [next(fresh) for _ in range(3)]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_mixture_weights_and_padding_buckets(tok, tmp_path):
  path = tmp_path / "a.jsonl"
  export_jsonl(get_task("countdown"), str(path), "train", 30)
  src = [Source.parse("task:arithmetic@3"), Source.parse(f"jsonl:{path}@1")]
  it = iter(prompt_stream(src, tok, batch_size=40, seed=0))
  tasks = [r.get("task") for r in next(it)["records"]]
  assert tasks.count("arithmetic") == 30 and tasks.count("countdown") == 10
  it = iter(sft_batches(src, tok, batch_size=4, max_len=64, seed=0, pad_multiple=16))
  assert all(next(it)["tokens"].shape[1] % 16 == 0 for _ in range(5))


def test_prompt_stream_holds_prompt_ids_and_records(tok):
  src = [Source.parse("task:countdown")]
  batch = next(iter(prompt_stream(src, tok, batch_size=3, seed=0)))
  assert len(batch["prompt_ids"]) == len(batch["records"]) == 3
  for ids, r in zip(batch["prompt_ids"], batch["records"]):
    assert tok.decode(ids) == r["prompt"] + "\n"


def test_held_out_records(tmp_path):
  path = tmp_path / "a.jsonl"
  export_jsonl(get_task("arithmetic"), str(path), "test", 5)
  assert len(Source.parse(f"jsonl:{path}").held_out(100, 0)) == 5
  recs = Source.parse("task:arithmetic?max_digits=3").held_out(50, 0)
  assert len({r["prompt"] for r in recs}) == 50


def test_jsonl_with_bom_and_crlf(tmp_path):
  recs = [{"prompt": "What is 1+1?", "answer": "#### 2"}, {"prompt": "é?", "answer": "x"}]
  path = tmp_path / "win.jsonl"
  path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(r, ensure_ascii=False)
                                               for r in recs).encode() + b"\r\n")
  assert read_jsonl(str(path)) == recs


def test_blank_prompt_is_a_bad_line(tmp_path, caplog):
  good = json.dumps({"prompt": "p", "answer": "a"})
  path = _write(tmp_path / "d.jsonl", [good, json.dumps({"prompt": " \n", "answer": "a"}),
                                       json.dumps({"prompt": "", "answer": "a"})])
  with pytest.raises(JsonlError, match=r"d\.jsonl:2: field 'prompt' is empty"):
    read_jsonl(path)
  with caplog.at_level(logging.WARNING):
    assert read_jsonl(path, skip_bad_lines=True) == [json.loads(good)]
  assert "skipped 2 bad line(s): [2, 3]" in caplog.text


def _numbered(tmp_path, n=400, name="q.jsonl"):
  """``n`` distinct records, then a duplicate of each of the first 20 prompts."""
  recs = [{"prompt": f"question {i}", "answer": str(i)} for i in range(n)]
  recs += [{"prompt": f"question {i}", "answer": "other"} for i in range(20)]
  return _write(tmp_path / name, [json.dumps(r) for r in recs]), recs


def test_jsonl_held_out_split_is_disjoint_and_deterministic(tmp_path, tok):
  path, recs = _numbered(tmp_path)
  src = Source.parse(f"jsonl:{path}?heldout=0.1@2")
  train, held = list(src.records("train", 0)), src.held_out(10_000, 0)
  prompts = lambda rs: {r["prompt"] for r in rs}  # noqa: E731
  assert not prompts(train) & prompts(held)  # duplicates land on one side
  assert len(train) + len(held) == len(recs) and 20 <= len(held) <= 60
  assert held == [r for r in recs if in_held_out(r["prompt"], 0.1)]  # file order
  assert src.held_out(5, 0) == held[:5] == src.held_out(5, 7)  # seed-free
  assert list(src.records("test", 0)) == held
  # Larger fractions only add records: the 10% split is inside the 20% one.
  assert prompts(held) < prompts(Source.parse(f"jsonl:{path}?heldout=0.2").held_out(10_000, 0))
  assert src.held_out_is_disjoint and not Source.parse(f"jsonl:{path}").held_out_is_disjoint
  assert Source.parse("task:countdown").held_out_is_disjoint
  # The training stream never yields a held-out prompt.
  it = iter(prompt_stream([src], tok, batch_size=50, seed=0))
  streamed = [r["prompt"] for _ in range(20) for r in next(it)["records"]]
  assert len(set(streamed)) == len(prompts(train)) and not set(streamed) & prompts(held)


def test_jsonl_without_held_out_is_one_split(tmp_path):
  path, recs = _numbered(tmp_path, n=30)
  src = Source.parse(f"jsonl:{path}")
  assert list(src.records("train", 0)) == recs and src.held_out(4, 0) == recs[:4]


@pytest.mark.parametrize("spec,message", [
    ("jsonl:/x.jsonl?heldout=1", r"heldout must be a fraction of the file in \(0, 1\).* got 1"),
    ("jsonl:/x.jsonl?heldout=0", r"heldout must be a fraction.* got 0"),
    ("jsonl:/x.jsonl?heldout=true", r"heldout must be a fraction.* got True"),
    ("jsonl:/x.jsonl?heldout=\"5%\"", r"heldout must be a fraction.* got '5%'"),
    ("jsonl:/x.jsonl?held_out=0.1", r"unknown jsonl parameter\(s\) \['held_out'\]"),
])
def test_bad_held_out_values(spec, message):
  with pytest.raises(ValueError, match=r"bad data source .*" + message):
    Source.parse(spec)


def test_held_out_fraction_leaving_a_side_empty(tmp_path):
  path = _write(tmp_path / "one.jsonl", [json.dumps({"prompt": "p", "answer": "a"})])
  side = "train" if in_held_out("p", 0.5) else "test"  # the side "p" is not on
  with pytest.raises(JsonlError, match=rf"one\.jsonl: heldout=0\.5 leaves no {side} records"):
    Source.parse(f"jsonl:{path}?heldout=0.5").records(side, 0)
