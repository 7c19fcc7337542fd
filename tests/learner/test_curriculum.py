"""The GRPO curriculum draws families where the policy both passes and fails, keeps every
family in reach, and resumes exactly from its saved state."""

import collections

import pytest

from learner.curriculum import FamilyCurriculum

FAMILIES = ["easy"] * 5 + ["hard"] * 5 + ["mixed"] * 5


def draws(curriculum, n):
    return collections.Counter(FAMILIES[curriculum.next_index()] for _ in range(n))


def test_with_no_record_every_family_is_as_likely():
    assert list(FamilyCurriculum(FAMILIES).weights().values()) == [pytest.approx(1 / 3)] * 3


def test_families_passed_or_failed_every_time_are_drawn_less_but_still_drawn():
    c = FamilyCurriculum(FAMILIES, seed=1)
    for _ in range(10):
        c.record("easy", [True] * 8)
        c.record("hard", [False] * 8)
        c.record("mixed", [True, False] * 4)
    counts = draws(c, 3000)
    assert counts["mixed"] > 3 * counts["easy"] and counts["mixed"] > 3 * counts["hard"]
    assert counts["easy"] > 0 and counts["hard"] > 0


def test_within_a_family_tasks_come_in_order_and_wrap():
    c = FamilyCurriculum(["a", "b", "a"])
    c.record("b", [True] * 50)                     # b all but never drawn; a in order
    picks = [c.next_index() for _ in range(200)]
    a = [i for i in picks if i != 1]
    assert a[:4] == [0, 2, 0, 2]


def test_a_restored_curriculum_draws_what_the_original_would():
    a = FamilyCurriculum(FAMILIES, seed=3)
    a.record("hard", [False] * 8)
    [a.next_index() for _ in range(7)]
    b = FamilyCurriculum(FAMILIES, seed=3)
    b.load_state(a.state())
    assert [a.next_index() for _ in range(20)] == [b.next_index() for _ in range(20)]


def test_the_estimate_follows_a_policy_that_changes():
    c = FamilyCurriculum(FAMILIES, decay=0.5)
    for _ in range(10):
        c.record("hard", [False] * 8)
    assert c.stats["hard"].pass_rate < 0.1
    for _ in range(3):
        c.record("hard", [True, False] * 4)
    assert c.stats["hard"].pass_rate > 0.4


def test_a_task_that_was_mixed_is_drawn_again_until_the_policy_settles_it():
    c = FamilyCurriculum(FAMILIES, seed=2, revisit=0.5)
    c.record("mixed", [True, False] * 4, index=12)
    c.record("mixed", [True] * 8, index=13)             # uniform: not pooled
    picks = [c.next_index() for _ in range(600)]
    mixed = [i for i in picks if FAMILIES[i] == "mixed"]
    assert mixed.count(12) > len(mixed) / 3             # ~half of the family's draws, + its turn
    assert mixed.count(13) < len(mixed) / 6
    c.record("mixed", [False] * 8, index=12)            # settled (all fail): out of the pool
    later = [i for i in (c.next_index() for _ in range(600)) if FAMILIES[i] == "mixed"]
    assert later.count(12) < len(later) / 4             # its turn in order: 1 / 5
    plain = FamilyCurriculum(FAMILIES, seed=2)
    plain.record("mixed", [True, False] * 4, index=12)
    assert plain.pools["mixed"] == []


def test_the_pool_is_saved_and_restored():
    a = FamilyCurriculum(FAMILIES, seed=3, revisit=0.7)
    a.record("hard", [True] + [False] * 7, index=6)
    b = FamilyCurriculum(FAMILIES, seed=3, revisit=0.7)
    b.load_state(a.state())
    assert b.pools["hard"] == [6]
    assert [a.next_index() for _ in range(30)] == [b.next_index() for _ in range(30)]
