"""`bench.spec`'s round cost model from device-loop seconds per round."""

import pytest

from spec_rl_jax.bench.spec import round_costs


def test_round_costs_split_a_round_into_verification_and_drafting():
  # AR rounds take 2 ms. K = 3: draft-model rounds 7 ms, n-gram rounds 3 ms.
  round_s = {"ar": 2e-3, "draft_model_k3": 7e-3, "ngram_k3": 3e-3,
             "draft_model_k1": 4e-3, "ngram_k1": 2.5e-3}
  acceptance = {"draft_model_k3": 3.0, "ngram_k3": 1.2, "draft_model_k1": 1.75,
                "ngram_k1": 1.1}
  out = round_costs(round_s, acceptance, [1, 3])
  assert out["round"][3] == pytest.approx(3.5)
  assert out["verify"][3] == pytest.approx(1.5)
  assert out["draft"][3] == pytest.approx(2.0)
  assert out["ceiling"][3] == pytest.approx(2.0)  # 3 tokens for 1.5 AR steps
  assert (out["round"][1], out["draft"][1]) == pytest.approx((2.0, 0.75))
  assert out["ceiling"][1] == pytest.approx(1.75 / 1.25)
  assert out["step"][3] == pytest.approx(2.0 / 3)  # one draft forward: 2/3 of an AR step
  # Any model drafter by name, against the same verification cost.
  eagle = round_costs({**round_s, "eagle3_k3": 4e-3}, {"eagle3_k3": 2.5}, [3], "eagle3")
  assert (eagle["draft"][3], eagle["step"][3]) == pytest.approx((0.5, 0.5 / 3))


def test_round_costs_need_the_free_drafter_at_every_k():
  with pytest.raises(KeyError, match="ngram_k2"):
    round_costs({"ar": 1.0, "draft_model_k2": 2.0}, {"draft_model_k2": 2.0}, [2])
