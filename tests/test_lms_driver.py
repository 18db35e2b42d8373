"""The planning loop (lms_core.driver): a plan for a budget, measured, planned again until it fits.

The strategies here are plain functions of the budget with the property the loop exists for: the
device holds a fixed amount the planner's figure misses (cuDNN's workspaces, the executor running
ahead). The numbers are worked out by hand in each test, on a 16 GiB device whose fit limit is
16 x 0.95 = 15.2 GiB and whose margin is 2% of 16 GiB = 0.32 GiB.
"""
from __future__ import annotations

import pytest

from lms_core.driver import (Feedback, Proposal, Round, better, fit_limit, fits, miss_based, overshoot_based,
                             plan_until_it_fits)

GIB = 1 << 30
DEVICE = 16 * GIB
LIMIT = fit_limit(DEVICE)


def calibrated(propose, measure, budget: int, rounds: int = 4, log=None):
    """The loop as a GPU rank runs it (launcher.lms.calibrate)."""
    return plan_until_it_fits(propose, measure, budget, LIMIT, rounds, miss_based(DEVICE),
                              log and (lambda done: log(done.describe())))


def gib(x: float) -> int:
    return int(round(x * GIB))


def filling(miss_gib: float, step_s: float = 1.0, unswapped_s: float = 1.0):
    """A strategy whose plan fills its budget, on a device that holds `miss_gib` more than that."""
    def propose(budget: int) -> Proposal:
        return Proposal(f"plan for {budget}", budget, budget, step_s, unswapped_s)

    def measure(proposal: Proposal) -> Feedback:
        return Feedback(proposal.predicted_bytes + gib(miss_gib), step_s)

    return propose, measure


def test_a_plan_that_fits_at_once_is_kept_after_one_round():
    propose, measure = filling(miss_gib=0.5)  # 14.4 + 0.5 = 14.9 <= 15.2
    lines: list[str] = []
    outcome = calibrated(propose, measure, gib(14.4), log=lines.append)
    assert len(outcome.rounds) == 1 and outcome.chosen is outcome.rounds[0]
    assert outcome.chosen.next_budget_bytes is None
    assert lines == ["calibration round 1: budget 14.40 GiB, predicted peak 14.40 GiB, step 1000 ms; measured peak "
                     "14.90 GiB, step 1000 ms (+3% on the predicted peak); fits"]


def test_the_next_budget_is_lowered_by_what_the_model_missed_plus_the_margin():
    # 14.4 + 2 = 16.4 > 15.2: the next budget is 15.2 - 2 - 0.32 = 12.88, whose plan peaks at 14.88: fits.
    propose, measure = filling(miss_gib=2.0)
    outcome = calibrated(propose, measure, gib(14.4))
    budgets = [r.proposal.budget_bytes for r in outcome.rounds]
    assert budgets == [gib(14.4), pytest.approx(gib(12.88), abs=2)]
    assert [r.fits for r in outcome.rounds] == [False, True]
    assert outcome.chosen is outcome.rounds[1]
    assert outcome.rounds[0].unmodeled_bytes == gib(2.0)


def test_out_of_memory_lowers_the_budget_by_at_least_what_the_device_refused():
    """An out-of-memory error reports a lower bound: here the device itself, 16 GiB, for a plan
    predicted at 14.4, so the miss is at least 1.6: the next budget is 15.2 - 1.6 - 0.32 = 13.28."""
    def propose(budget: int) -> Proposal:
        return Proposal(budget, budget, budget)

    def measure(proposal: Proposal) -> Feedback:
        if proposal.budget_bytes > gib(13.5):
            return Feedback(DEVICE, out_of_memory="OOM when allocating tensor with shape[256,1024,14,14]")
        return Feedback(proposal.budget_bytes + gib(1.0), 2.0)

    outcome = calibrated(propose, measure, gib(14.4))
    assert [r.proposal.budget_bytes for r in outcome.rounds] == [gib(14.4), pytest.approx(gib(13.28), abs=2)]
    assert outcome.rounds[0].describe().endswith("out of memory (needed more than 16.00 GiB); next budget 13.28 GiB")
    assert outcome.chosen is outcome.rounds[1]


def test_a_device_whose_peak_no_plan_moves_ends_after_the_rounds_with_nothing_chosen():
    """A CPU rank's two logical devices share one allocator: the peak is 17 GiB whatever is swapped.
    Each round the miss is 17 - budget, so the next budget is 15.2 - (17 - b) - 0.32 = b - 2.12."""
    def propose(budget: int) -> Proposal:
        return Proposal(budget, budget, budget)

    outcome = calibrated(propose, lambda proposal: Feedback(gib(17)), gib(14.4), rounds=3)
    budgets = [r.proposal.budget_bytes for r in outcome.rounds]
    assert budgets == [gib(14.4), pytest.approx(gib(12.28), abs=2), pytest.approx(gib(10.16), abs=2)]
    assert outcome.chosen is None and outcome.rounds[-1].next_budget_bytes is None


def test_no_budget_below_five_percent_of_the_device_is_tried():
    # 1 GiB with a 15 GiB miss: next would be 15.2 - 15 - 0.32 < 0: nothing left to plan for.
    propose, measure = filling(miss_gib=15.0)
    outcome = calibrated(propose, measure, gib(1.0))
    assert len(outcome.rounds) == 1 and outcome.chosen is None


def test_a_stalling_plan_with_room_is_planned_again_for_more_and_the_faster_kept():
    """Budget 8 GiB, peak 8.5 (miss 0.5), step twice the unswapped one: the next budget is
    15.2 - 0.5 - 0.32 = 14.38. The plan for it swaps less and runs faster, so it is kept."""
    def propose(budget: int) -> Proposal:
        step = 2.0 if budget < gib(10) else 1.2
        return Proposal(budget, budget, budget, step, 1.0)

    def measure(proposal: Proposal) -> Feedback:
        return Feedback(proposal.budget_bytes + gib(0.5), proposal.predicted_step_s)

    outcome = calibrated(propose, measure, gib(8.0))
    assert [r.proposal.budget_bytes for r in outcome.rounds] == [gib(8.0), pytest.approx(gib(14.38), abs=2)]
    assert outcome.chosen is outcome.rounds[1]
    assert outcome.rounds[1].next_budget_bytes is None  # 1.2 s is still over 1.05 s, but no room is left


def test_a_raised_budget_that_does_not_fit_sends_the_loop_back_and_the_earlier_plan_is_kept():
    """Raised from 8 to 14.38 GiB, the plan's real peak is 16.9 (this plan misses 2.5): it does not
    fit. The next budget, 15.2 - 2.5 - 0.32 = 12.38, is planned and kept if faster than round 1."""
    def propose(budget: int) -> Proposal:
        return Proposal(budget, budget, budget, 2.0 if budget < gib(10) else 1.5, 1.0)

    def measure(proposal: Proposal) -> Feedback:
        miss = 0.5 if proposal.budget_bytes < gib(10) else 2.5
        return Feedback(proposal.budget_bytes + gib(miss), proposal.predicted_step_s)

    outcome = calibrated(propose, measure, gib(8.0))
    budgets = [r.proposal.budget_bytes for r in outcome.rounds]
    assert budgets == [gib(8.0), pytest.approx(gib(14.38), abs=2), pytest.approx(gib(12.38), abs=2)]
    assert [r.fits for r in outcome.rounds] == [True, False, True]
    assert outcome.chosen is outcome.rounds[2]  # 1.5 s beats 2.0 s
    # Round 3 stalls and has room, but a raise could only go to 14.38 - 0.32 = 14.06 (under the budget that
    # failed), and 14.06 - 12.38 = 1.68 >= the margin: so round 4 would be tried; with 3 rounds it is not.
    short = calibrated(propose, measure, gib(8.0), rounds=3)
    assert short.rounds[-1].next_budget_bytes is None


def test_fits_leaves_the_headroom_free_and_better_prefers_the_faster_then_the_lower():
    assert LIMIT == int(DEVICE * 0.95)
    assert fits(Feedback(LIMIT), LIMIT) and not fits(Feedback(LIMIT + 1), LIMIT)
    assert not fits(Feedback(gib(1.0), out_of_memory="OOM"), LIMIT)
    propose, _ = filling(0)

    def done(peak: float, step: float, fitted: bool = True, measured: bool = True) -> Round:
        return Round(1, propose(gib(10)), Feedback(gib(peak), step, measured=measured), fitted, None)

    fast, slow = done(14, 1.0), done(10, 1.5)
    assert better(fast, slow, LIMIT) is fast and better(slow, fast, LIMIT) is fast
    close_high, close_low = done(14, 1.0), done(10, 1.005)  # measured within 1%: the lower peak
    assert better(close_high, close_low, LIMIT) is close_low
    # A model's times are exact: 0.5% faster is faster.
    assert better(done(14, 1.0, measured=False), done(10, 1.005, measured=False), LIMIT).feedback.peak_bytes == gib(14)
    # Neither fits: the lower peak, unless within 1% of the limit (0.152 GiB): then the faster.
    low, high = done(15.5, 2.0, False), done(16.0, 1.0, False)
    assert better(high, low, LIMIT) is low
    near = done(15.6, 1.0, False)
    assert better(low, near, LIMIT) is near
    assert better(slow, done(9, 0.5, False), LIMIT) is slow  # fitting beats not fitting


def test_rounds_must_be_at_least_one():
    propose, measure = filling(0)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        plan_until_it_fits(propose, measure, gib(1), LIMIT, 0, miss_based(DEVICE))


def test_a_model_that_counts_as_the_planner_does_lowers_the_budget_by_its_overshoot():
    """Grappler's estimate and the allocator model: 14.4 GiB planned, judged 16.9 against a limit of
    16: the next budget is 14.4 - 0.9 = 13.5; with a minimum step of 1 GiB an overshoot of 0.25 still
    lowers it by 1. A plan over its own budget by the planner's figure ends the loop at once."""
    judged = {gib(14.4): gib(16.9), gib(13.5): gib(15.2)}
    outcome = plan_until_it_fits(lambda b: Proposal(b, b, b),
                                 lambda p: Feedback(judged[p.budget_bytes], measured=False),
                                 gib(14.4), 16 * GIB, 4, overshoot_based())
    assert [r.proposal.budget_bytes for r in outcome.rounds] == [gib(14.4), gib(13.5)]
    assert outcome.chosen is outcome.rounds[1]
    stepped = plan_until_it_fits(lambda b: Proposal(b, b, b), lambda p: Feedback(gib(16.25), measured=False),
                                 gib(14.4), 16 * GIB, 2, overshoot_based(min_step_bytes=GIB))
    assert [r.proposal.budget_bytes for r in stepped.rounds] == [gib(14.4), gib(13.4)]
    assert stepped.chosen is None and stepped.best is stepped.rounds[0]  # alike peaks: the first
    over_its_own = plan_until_it_fits(lambda b: Proposal(b, b, b + GIB), lambda p: Feedback(gib(17), measured=False),
                                      gib(14.4), 16 * GIB, 4, overshoot_based())
    assert len(over_its_own.rounds) == 1
