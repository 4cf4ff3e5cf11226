"""The step cost model: its defaults follow from the figures it cites, and a step's time is the sum of its terms."""

from __future__ import annotations

import pytest

from kv_tooling.cost_model import StepCostModel, StepWork

# Round numbers, so that every term below is checked by hand.
ROUND = StepCostModel(
    prefill_us_per_token=10.0, decode_step_ms=2.0, decode_us_per_row=5.0, hbm_gb_per_s=1.0,
    kv_bytes_per_token=1000, link_gb_per_s=2.0,
)  # fmt: skip


def test_the_defaults_are_llama3_8b_in_bf16_on_an_h200() -> None:
    model = StepCostModel()
    assert model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    # 2 FLOPs per parameter of 8.03e9, at 40% of 989 dense bf16 TFLOPS.
    assert model.prefill_us_per_token == pytest.approx(2 * 8.03e9 / (0.40 * 989e12) * 1e6)
    assert model.prefill_us_per_token == pytest.approx(40.6, abs=0.05)
    assert 20_000 < model.prefill_tokens_per_s < 30_000  # the order one such GPU prefills
    assert model.decode_us_per_row == model.prefill_us_per_token  # the same FLOPs per token
    assert model.decode_step_ms == pytest.approx(16.06e9 / 4.8e12 * 1e3)  # the bf16 weights read once at 4.8 TB/s
    assert (model.hbm_gb_per_s, model.link_gb_per_s) == (4800.0, 55.0)


@pytest.mark.parametrize(
    ("work", "seconds"),
    [
        (StepWork(), 0.0),
        (StepWork(num_prefill_tokens=100), 100 * 10e-6),
        (StepWork(num_decode_rows=4), 2e-3 + 4 * 5e-6),  # the weights once, then each row
        (StepWork(num_decode_rows=4, num_decode_kv_tokens=1000), 2e-3 + 4 * 5e-6 + 1000 * 1000 / 1e9),
        (StepWork(num_copied_tokens=500), 500 * 1000 / 2e9),
        (StepWork(100, 4, 1000, 500), 100 * 10e-6 + 2e-3 + 4 * 5e-6 + 1000 * 1000 / 1e9 + 500 * 1000 / 2e9),
    ],
)
def test_a_step_costs_the_sum_of_its_terms(work: StepWork, seconds: float) -> None:
    assert ROUND.step_s(work) == pytest.approx(seconds)


def test_a_prefill_only_step_does_not_pay_the_decode_floor() -> None:
    assert ROUND.step_s(StepWork(num_prefill_tokens=1)) < ROUND.decode_step_ms * 1e-3


def test_a_decode_row_at_the_defaults_reads_its_context_at_the_hbm_rate() -> None:
    model = StepCostModel()
    short = model.step_s(StepWork(num_decode_rows=1, num_decode_kv_tokens=1))
    long = model.step_s(StepWork(num_decode_rows=1, num_decode_kv_tokens=1001))
    assert long - short == pytest.approx(1000 * 131_072 / 4.8e12)  # 27 us per 1,000 tokens


@pytest.mark.parametrize(
    "field", ["prefill_us_per_token", "decode_step_ms", "decode_us_per_row", "kv_bytes_per_token", "hbm_gb_per_s",
              "link_gb_per_s"],
)  # fmt: skip
def test_a_negative_parameter_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        StepCostModel(**{field: -1})


@pytest.mark.parametrize("field", ["hbm_gb_per_s", "link_gb_per_s"])
def test_a_rate_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        StepCostModel(**{field: 0.0})
