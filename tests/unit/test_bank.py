"""The time bank alone (tracking/bank.py): what an RL step earns, what a step may cost, and how a batch is cut to
what the bank covers. No model, no clock: times are given."""
from __future__ import annotations

import pytest
import torch

from drafttrain.tracking.bank import MARGIN, STARVED, TimeBank, padded_tokens


def _group(*lengths: int) -> list[dict]:
    return [{"aux": torch.zeros(n, 2)} for n in lengths]


def test_an_rl_step_earns_its_share_capped_and_pays_its_capture_at_once():
    bank = TimeBank(budget_frac=0.05, time_budget_s=0.1)
    bank.earn(rl_s=1.0, capture_s=0.01)
    assert bank.bank_s == pytest.approx(0.04)
    bank.earn(rl_s=100.0, capture_s=0.0)  # 5 s earned, capped at time_budget_s
    assert bank.bank_s == pytest.approx(0.1)
    bank.spend(0.12)
    assert bank.bank_s == pytest.approx(-0.02)


def test_allowance_keeps_back_the_updates_predicted_fixed_work():
    bank = TimeBank(0.05, time_budget_s=1.0)
    bank.bank_s = 0.5
    assert bank.allowance(spent=0.1, banked=False) == pytest.approx(0.9)  # time_budget_s alone
    assert bank.allowance(spent=0.1, banked=True) == pytest.approx(0.4)  # nothing measured: no fixed work yet
    bank.fixed_took(0.08)
    assert bank.allowance(spent=0.1, banked=True) == pytest.approx(0.4 - MARGIN * 0.08)


def test_fit_takes_the_longest_prefix_whose_predicted_step_fits():
    bank = TimeBank(0.05, 1.0)
    group = _group(2, 2, 4, 8)  # ascending lengths, as the buffer groups them
    assert bank.fit(group, 1e-9) is group  # nothing measured: the whole group
    bank.step_took(0.01, _group(10))  # 1 ms a padded token
    assert bank.tok_cost_s == pytest.approx(0.001)
    per_tok = MARGIN * 0.001
    assert bank.fit(group, None) is group
    assert bank.fit(group, per_tok * 1 * 2 - 1e-12) is None  # not one record
    assert bank.fit(group, per_tok * 2 * 2) == group[:2]  # 2 rows x 2 tokens
    assert bank.fit(group, per_tok * 3 * 4) == group[:3]  # the third row pads the batch to 4
    assert bank.fit(group, per_tok * 4 * 8) == group


def test_covers_predicts_whole_batches_against_the_allowance():
    bank = TimeBank(0.05, 1.0)
    groups = [_group(2, 4), _group(8)]  # 8 + 8 padded tokens
    assert bank.covers(groups, 0.0)  # nothing measured: the first update is not held back
    bank.step_took(0.01, _group(10))  # 1 ms a padded token
    assert bank.covers(groups, MARGIN * 0.016)
    assert not bank.covers(groups, MARGIN * 0.016 - 1e-9)
    assert bank.covers(groups[:1], MARGIN * 0.008) and not bank.covers(groups[:1], MARGIN * 0.008 - 1e-9)


def test_costs_are_moving_averages_and_travel_with_the_state():
    bank = TimeBank(0.05, 1.0)
    assert not bank.measured
    bank.step_took(0.010, _group(5, 5))  # 1 ms a padded token
    bank.step_took(0.060, _group(3, 10))  # 3 ms a padded token
    assert padded_tokens(_group(3, 10)) == 20
    assert bank.tok_cost_s == pytest.approx(0.8 * 0.001 + 0.2 * 0.003)
    bank.fixed_took(0.5)
    bank.fixed_took(1.0)
    assert bank.measured and bank.fixed_cost_s == pytest.approx(0.6)
    bank.earn(1.0, 0.0)
    again = TimeBank(0.05, 1.0)
    again.load_state_dict(bank.state_dict())
    assert again.state_dict() == bank.state_dict() and again.bank_s == pytest.approx(0.05)


def test_a_capture_longer_than_the_cap_is_paid_from_the_earnings_before_the_cap():
    """A step earning 50 s with 12 s of capture, the bank capped at 10 s: it holds 10 s. Capped before the capture
    was paid, it held 10 - 12 = -2 s after every step, and the drafter never trained (silently)."""
    bank = TimeBank(budget_frac=0.05, time_budget_s=10.0)
    for _ in range(3):
        bank.earn(rl_s=1000.0, capture_s=12.0)
        assert bank.bank_s == pytest.approx(10.0)
    bank.earn(rl_s=100.0, capture_s=12.0)  # 5 s earned, 12 s of capture: in debt, as it should be
    assert bank.bank_s == pytest.approx(3.0)


def test_a_starved_bank_says_so_once_with_the_key_to_change():
    bank = TimeBank(budget_frac=0.01, time_budget_s=10.0)
    lines = []
    for i in range(3 * STARVED):
        bank.earn(rl_s=1.0, capture_s=0.05)  # earns 0.01 s, spends 0.05 on capture
        lines.append(bank.fed(trained=False))
    said = [x for x in lines if x]
    assert len(said) == 1 and lines.index(said[0]) == STARVED - 1
    assert f"has not trained for {STARVED} RL steps" in said[0] and "online.budget_frac" in said[0]
    assert "\n" not in said[0] and "capture costs 0.05 s" in said[0]
    assert bank.fed(trained=True) is None and bank.starved == 0  # a step resets it; the next run says it again
    assert [bank.fed(trained=False) for _ in range(STARVED)][-1]


def test_a_drafter_step_above_the_cap_is_named_as_the_reason():
    bank = TimeBank(budget_frac=0.05, time_budget_s=1.0)
    bank.step_took(2.0, _group(100))  # 20 ms a token: one record of 100 tokens costs 2 s > 1 s
    line = None
    for _ in range(STARVED):
        bank.earn(rl_s=100.0, capture_s=0.0)
        line = bank.fed(False, bank.one_record_s([_group(100, 120)])) or line
    assert line and "one record costs ~2.00 s" in line and "online.time_budget_s=1" in line


def test_a_record_past_train_max_len_costs_its_window():
    """A drafter step trains a record longer than train.max_len on a window of that many positions: the bank prices
    it so (it priced the whole record, 4x a 4k window for a 16k row, and bought a quarter of the steps it could)."""
    bank = TimeBank(0.05, 100.0, max_len=4096)
    assert padded_tokens(_group(16384, 100), 4096) == 2 * 4096 and padded_tokens(_group(16384, 100)) == 2 * 16384
    bank.step_took(8.192, _group(16384, 16384))  # two windows of 4,096 positions: 1 ms a position
    assert bank.tok_cost_s == pytest.approx(0.001)
    per = MARGIN * 0.001
    two = _group(16384, 20000, 30000)
    assert len(bank.fit(two, per * 2 * 4096)) == 2 and len(bank.fit(two, per * 3 * 4096)) == 3
    assert bank.fit(_group(16384), per * 4096 - 1e-9) is None
