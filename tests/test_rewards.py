"""Rewards: math-verify on real-world answer formats, task verifiers by record field."""

import threading

import pytest

import numpy as np

from spec_rl_jax.rl.rewards import (REWARDS, get_reward, math_reward, reward_for,
                                    score_batch)

GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
              "#### 72")

# (model response, reference answer, expected reward)
CASES = [
    # GSM8K: "####" answers, commas, currency, trailing words and periods.
    ("She sold 72 clips in total.\n#### 72", GSM8K_GOLD, 1.0),
    ("#### 72.", GSM8K_GOLD, 1.0),
    ("#### 72 clips", GSM8K_GOLD, 1.0),
    ("The answer is 72", GSM8K_GOLD, 1.0),
    ("#### 73", GSM8K_GOLD, 0.0),
    ("She sold 72 clips in May... no: #### 96", GSM8K_GOLD, 0.0),
    ("#### 1,234", "#### 1234", 1.0),
    ("#### 1234", "... #### 1,234", 1.0),
    ("Total cost: \\$18.", "#### 18", 1.0),
    ("Total cost: $18", "#### 18", 1.0),
    ("#### 18.00", "#### 18", 1.0),
    ("#### 18.5", "#### 18", 0.0),
    ("#### -5", "#### 5", 0.0),
    # MATH: \boxed{} LaTeX answers, fractions, radicals, percentages, units.
    ("so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("$\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{7}{2}}", "3.5", 1.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{8}", 0.0),
    ("The length is \\boxed{5\\text{ cm}}.", "5", 1.0),
    ("\\boxed{5 \\text{ meters}}", "\\boxed{5}", 1.0),
    ("The answer is $\\frac{3}{4}$", "0.75", 1.0),
    ("\\boxed{50\\%}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{x^2-1}", "1+x^2", 0.0),
    ("The final answer is $\\boxed{(3, -1)}$", "(3,-1)", 1.0),
    ("I don't know.", "\\frac{1}{2}", 0.0),
    ("", "#### 7", 0.0),
]


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_math_reward_real_world_formats(response, answer, expected):
  assert math_reward(response, answer) == expected


def test_math_reward_off_the_main_thread():
  out = []
  t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
  t.start()
  t.join()
  assert out == [1.0]


def test_unparseable_reference_raises():
  with pytest.raises(ValueError, match="reference answer"):
    math_reward("#### 3", "The answer is: ####")


def test_reward_for_dispatches_on_the_task_field():
  arithmetic = {"prompt": "What is 2+3?", "answer": "2+3=5. #### 5", "task": "arithmetic"}
  countdown = {"prompt": "Use 2 3 to make 6.", "answer": "2*3=6. #### 2*3",
               "task": "countdown"}
  user = {"prompt": "What is half of one?", "answer": "#### 0.5"}  # no task field: math
  assert reward_for(arithmetic, "#### 5") == 1.0
  assert reward_for(arithmetic, "#### 5.5") == 0.0
  assert reward_for(countdown, "#### 3*2") == 1.0
  assert reward_for(countdown, "#### 6") == 0.0  # math would accept; the task does not
  assert reward_for(user, "\\boxed{\\frac{1}{2}}") == 1.0
  assert list(score_batch([arithmetic, user], ["#### 5", "#### 7"]).reward) == [1.0, 0.0]
  with pytest.raises(ValueError, match="responses"):
    score_batch([arithmetic], [])
  with pytest.raises(KeyError, match="known rewards"):
    get_reward("sudoku")
  assert {"math", "arithmetic", "countdown"} <= set(REWARDS)


def test_format_reward_and_unreadable_answers_are_scored_and_counted():
  mul = {"prompt": "What is 12*3?", "task": "multiplication",
         "answer": "12*3: 2*3=6, 1*3=3, so 36. #### 36"}
  user = {"prompt": "What is 6*6?", "answer": "#### 36"}
  responses = [mul["answer"],                          # right and well formed
               "12*3: 2*3=6, 1*3=3, so 36. #### 35",   # well formed, wrong
               "thirty-six #### 36",                   # right, worked part malformed
               "12*3: 2*3=6, 1*3=3, so 36. #### ?!",   # math-verify reads nothing
               "#### 36"]                              # no task grammar: a final answer
  s = score_batch([mul] * 4 + [user], responses, format_weight=0.25)
  np.testing.assert_array_equal(s.correct, [1, 0, 1, 0, 1])
  np.testing.assert_array_equal(s.well_formed, [True, True, False, True, True])
  np.testing.assert_array_equal(s.readable, [True, True, True, False, True])
  np.testing.assert_allclose(s.reward, [1.25, 0.25, 1.0, 0.25, 1.25])
  assert list(score_batch([mul], ["#### 36"]).reward) == [1.0]  # weight 0: correctness
