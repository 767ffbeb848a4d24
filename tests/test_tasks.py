"""Built-in tasks: deterministic generators, disjoint splits, verifiers, JSONL export."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from spec_rl_jax.tasks import TASKS, get_task
from spec_rl_jax.tasks.__main__ import main as tasks_main
from spec_rl_jax.tasks.arithmetic import Arithmetic, scratchpad
from spec_rl_jax.tasks.base import (export_jsonl, final_answer, iterate, parse_int,
                                    problem_at, record_at, split_of, unique_records)
from spec_rl_jax.tasks.countdown import Countdown, evaluate
from spec_rl_jax.tasks.multiplication import Multiplication, worked_solution

ALL = [get_task(n) for n in TASKS]
IDS = list(TASKS)


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_generator_is_deterministic_per_seed(task):
  a = list(itertools.islice(iterate(task, "train", seed=3), 50))
  b = list(itertools.islice(iterate(task, "train", seed=3), 50))
  c = list(itertools.islice(iterate(task, "train", seed=4), 50))
  assert a == b
  assert a != c
  assert record_at(task, "train", 3, 17) == a[17]  # random access = streaming


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_train_and_test_splits_are_disjoint(task):
  train = {problem_at(task, "train", s, i).key for s in range(3) for i in range(300)}
  test = {problem_at(task, "test", s, i).key for s in range(3) for i in range(100)}
  assert train and test and not train & test
  assert all(split_of(k) == "test" for k in test)


def test_split_is_a_fixed_fraction_of_the_problem_space():
  keys = [f"{a}+{b}" for a in range(100) for b in range(100)]
  share = np.mean([split_of(k) == "test" for k in keys])
  assert 0.08 < share < 0.12


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_reference_answers_verify_and_corruptions_do_not(task):
  for r in unique_records(task, "train", 0, 200):
    assert task.verify(r["answer"], r["answer"]) == 1.0
    final = final_answer(r["answer"])
    assert task.verify(r["answer"].replace(f"#### {final}", ""), r["answer"]) == 0.0
    assert task.verify(f"#### {final}1", r["answer"]) == 0.0


def test_unique_records_are_distinct_and_raise_when_the_space_runs_out():
  recs = unique_records(get_task("arithmetic", max_digits=2), "test", 0, 50)
  assert len({r["prompt"] for r in recs}) == 50
  with pytest.raises(ValueError, match="distinct problems"):
    unique_records(get_task("arithmetic", max_digits=1), "test", 0, 100)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**8), min_size=2, max_size=5))
def test_scratchpad_columns_sum_to_the_total(operands):
  steps = scratchpad(operands).rstrip(".").split(", ")
  digits, carry = [], 0
  for step in steps:
    lhs, total = step.split("=")
    assert sum(map(int, lhs.split("+"))) == int(total)
    digits.append(int(total) % 10)
    carry = int(total) // 10
  value = int(str(carry) + "".join(map(str, digits[::-1])) if carry else
              "".join(map(str, digits[::-1])))
  assert value == sum(operands)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**9))
def test_arithmetic_accepts_every_correct_form(total):
  answer = f"x. #### {total}"
  task = Arithmetic()
  forms = [f"#### {total}", f"####{total}", f"#### {total}.", f"#### {total}.00",
           f"#### +{total}", f"#### {total:,}", f"steps\n#### {total} \nmore", f" #### {total}"]
  for form in forms:
    assert task.verify(form, answer) == 1.0, form
  for wrong in [f"#### {total + 1}", f"{total}", "#### ", f"#### {total}.5",
                f"#### {total} apples", f"#### -{total + 1}"]:
    assert task.verify(wrong, answer) == 0.0, wrong


def test_parse_int():
  assert parse_int("1,234") == 1234 and parse_int("1234.") == 1234
  assert parse_int("12,34") is None and parse_int("") is None and parse_int("1e3") is None


@pytest.mark.parametrize("num_numbers", [2, 3, 4, 5])
def test_countdown_problems_are_solvable_as_stated(num_numbers):
  task = Countdown(num_numbers=num_numbers)
  rng = np.random.default_rng(0)
  for _ in range(100):
    p = task.sample(rng)
    numbers = [int(x) for x in p.prompt.split("Use ")[1].split(" to")[0].split()]
    target = int(p.prompt.split("make ")[1].rstrip("."))
    value, literals = evaluate(p.final)
    assert value == target and sorted(literals.elements()) == sorted(numbers)
    for step in p.solution.rstrip(".").split(", "):  # each step's arithmetic is right
      lhs, rhs = step.split("=")
      assert evaluate(lhs)[0] == int(rhs)


def test_countdown_verifier_forms():
  task = Countdown()
  answer = "25-19=6, 6*4=24, 24+3=27. #### (25-19)*4+3"
  for good in ["#### (25-19)*4+3", "#### 3+4*(25-19)", "#### (25 - 19) × 4 + 3",
               "#### ((25-19)*4)+3 = 27", "#### 4*(25-19)+3.", "#### 3+(25-19)*4"]:
    assert task.verify(good, answer) == 1.0, good
  for bad in ["#### 27", "#### (25-19)*4+3 = 28", "#### 25-19*4+3", "#### (25-19)*4",
              "#### (25-19)*4+3+0", "#### (25-19)*4+3*1", "#### -(19-25)*4+3",
              "#### (25-19)**4+3", "#### __import__('os')", "#### " + "(" * 300 + "1",
              "(25-19)*4+3", "#### (25-19)*4+3/0"]:
    assert task.verify(bad, answer) == 0.0, bad


def test_countdown_uses_rational_arithmetic():
  task = Countdown()
  answer = "#### 8/(3-8/3)"  # = 24 only with exact fractions
  assert evaluate("8/(3-8/3)")[0] == 24
  assert task.verify("#### 8/(3-8/3)", answer) == 1.0


def test_bad_difficulty_and_unknown_tasks_raise():
  with pytest.raises(ValueError, match="max_digits"):
    get_task("arithmetic", min_digits=3, max_digits=2)
  with pytest.raises(ValueError, match="no parameter"):
    get_task("countdown", digits=3)
  with pytest.raises(KeyError, match="known tasks"):
    get_task("sudoku")
  with pytest.raises(ValueError, match="split"):
    record_at(Arithmetic(), "validation", 0, 0)


def test_export_cli(tmp_path, capsys):
  out = tmp_path / "cd.jsonl"
  tasks_main(["countdown", "--split", "test", "--n", "7", "--out", str(out),
              "--param", "num_numbers=4", "--param", "max_number=20"])
  assert "wrote 7 countdown test records" in capsys.readouterr().out
  lines = [json.loads(x) for x in out.read_text().splitlines()]
  assert lines == unique_records(Countdown(num_numbers=4, max_number=20), "test", 0, 7)


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_export_jsonl_uses_the_prompt_answer_schema(task, tmp_path):
  path = tmp_path / "sub" / f"{task.name}.jsonl"
  assert export_jsonl(task, str(path), "test", 20, seed=1) == 20
  lines = [json.loads(x) for x in path.read_text().splitlines()]
  assert lines == unique_records(task, "test", 1, 20)
  assert all(set(r) == {"prompt", "answer", "task"} and "####" in r["answer"] for r in lines)


def test_counting_is_long_and_exact():
  from spec_rl_jax.tasks.counting import Counting
  task = Counting(min_span=100, max_span=250)
  for r in unique_records(task, "train", 0, 20):
    nums = r["answer"].split("####")[0].split()
    assert 100 <= len(nums) <= 250
    assert [int(x) for x in nums] == list(range(int(nums[0]), int(nums[-1]) + 1))
    skipped = " ".join(nums[:50] + nums[51:]) + f" #### {nums[-1]}"
    assert task.verify(skipped, r["answer"]) == 0.0
    assert task.verify(" ".join(nums) + f"\n#### {nums[-1]}", r["answer"]) == 1.0
  with pytest.raises(ValueError, match="min_span"):
    Counting(min_span=5, max_span=3)


def test_counting_geometric_spans_have_a_flat_stop_hazard():
  """With ``stop_hazard`` h the count stops after each number with probability h, however
  long it already is (so the length carries nothing about the stop), up to max_span."""
  from spec_rl_jax.tasks.counting import Counting
  task = Counting(min_span=3, max_span=40, stop_hazard=0.1)
  rng = np.random.default_rng(0)
  spans = np.array([int(b) - int(a) + 1 for a, b in
                    (task.sample(rng).key.split("-") for _ in range(20_000))])
  assert spans.min() == 3 and spans.max() <= 40
  for s in (3, 8, 15):  # P(span = s | span >= s), binomial std 0.002-0.004
    reached = (spans >= s).sum()
    assert abs((spans == s).sum() / reached - 0.1) < 0.02, s
  uniform = Counting(min_span=3, max_span=40)
  spans_u = [int(b) - int(a) + 1 for a, b in (uniform.sample(rng).key.split("-")
                                              for _ in range(4_000))]
  assert abs(np.mean(spans_u) - 21.5) < 0.6  # uniform stays the default
  with pytest.raises(ValueError, match="stop_hazard"):
    Counting(stop_hazard=1.0)


@pytest.mark.parametrize("a,b", [(483, 25), (7, 9), (5043, 45), (6732, 342), (120, 105),
                                 (99, 1000), (10, 10)])
def test_multiplication_worked_solution_is_right_step_by_step(a, b):
  """Every step's arithmetic, every partial product and the final sum are right."""
  lines = worked_solution(a, b).split("\n")
  partials = [x for x in lines if "*" in x]
  assert len(partials) == len(str(b))
  for line, digit in zip(partials, map(int, reversed(str(b)))):
    head, _, body = line.partition(": ")
    if digit == 0:
      assert line == f"{a}*0=0."
      continue
    assert head == f"{a}*{digit}"
    steps, _, value = body.rstrip(".").rpartition(", so ")
    for step in steps.split(", "):
      lhs, rhs = step.split("=")
      assert eval(lhs) == int(rhs)  # digits and + * only
    assert int(value) == a * digit
  shifted = [a * d * 10**i for i, d in enumerate(map(int, reversed(str(b)))) if d]
  if len(shifted) > 1:
    assert lines[-1].startswith("+".join(map(str, shifted)) + ": ")
    assert lines[-1].endswith(f", so {a * b}.")
  else:
    assert "+" not in lines[-1].split(": ")[0]


def test_multiplication_example_from_the_docstring():
  assert worked_solution(483, 25) == (
      "483*5: 3*5=15, 8*5+1=41, 4*5+4=24, so 2415.\n"
      "483*2: 3*2=6, 8*2=16, 4*2+1=9, so 966.\n"
      "2415+9660: 5+0=5, 1+6=7, 4+6=10, 2+9+1=12, so 12075.")


def test_multiplication_solutions_are_long_and_well_formed():
  task = Multiplication()
  recs = unique_records(task, "train", 0, 300)
  assert all(task.well_formed(r["answer"]) for r in recs)
  chars = [len(r["answer"]) for r in recs]
  assert 100 <= np.median(chars) <= 400  # ~1 token per character (single digits)


@pytest.mark.parametrize("response", [
    "#### 12075",                                               # no worked part
    "483*5: 3*5=15, so 2415. 2415+9660 #### 12075",              # sum line malformed
    "483*5: 3*5=15 8*5+1=41, so 2415.\n#### 12075",              # missing separator
    "483*5: 3*5=15, 8*5+1=41, so 2415.\n",                        # no final answer
    "483*5: 3*5=15, 8*5+1=41, so 2415.\nthe answer\n#### 12075"])  # stray text
def test_multiplication_malformed_worked_solutions_are_not_well_formed(response):
  assert not Multiplication().well_formed(response)


def test_multiplication_held_out_is_disjoint_even_with_the_training_seed():
  """Train and held-out streams drawn with the same seed never share a problem: the
  split is a hash of the problem, not of the seed."""
  task = Multiplication(max_digits=2, max_multiplier_digits=2)  # a small space: collisions
  train = {problem_at(task, "train", 0, i).key for i in range(2000)}
  test = {problem_at(task, "test", 0, i).key for i in range(300)}
  assert len(train) > 500 and len(test) > 50 and not train & test
