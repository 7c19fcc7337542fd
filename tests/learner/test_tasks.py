"""Simulated task generation: determinism, splits, variety, discrimination of hidden tests."""

from __future__ import annotations

import collections
import re
from random import Random

import pytest

from learner.tasks import (_FAMILY_MODULES, FAMILIES, Retry, generate, grade, instance_from_id,
                           make_instance)
from learner.tasks.kernels import KERNELS
from learner.tasks.repo import differs, outcome
from learner.tasks.vocab import DOMAINS


def _key(task):
    return (task.id, task.instruction, task.files, task.hidden_tests, task.solution, task.meta)


def test_generation_is_deterministic():
    a = generate("train", 24, seed=3)
    b = generate("train", 24, seed=3)
    assert [_key(t) for t in a] == [_key(t) for t in b]


def test_seeds_and_splits_give_different_instances():
    train0, train1 = generate("train", 12, seed=0), generate("train", 12, seed=1)
    heldout0 = generate("heldout", 12, seed=0)
    instructions = [t.instruction for t in train0 + train1 + heldout0]
    assert len(set(instructions)) == len(instructions)
    assert {t.id for t in train0}.isdisjoint(t.id for t in heldout0)


def test_at_least_six_families_all_generated_in_turn():
    assert len(FAMILIES) >= 6
    tasks = generate("train", 2 * len(FAMILIES))
    assert [t.family for t in tasks] == FAMILIES * 2


def test_families_argument_restricts_and_unknown_family_is_an_error():
    assert {t.family for t in generate("train", 5, families=["fix_bug"])} == {"fix_bug"}
    with pytest.raises(ValueError, match="unknown families"):
        generate("train", 1, families=["nope"])
    with pytest.raises(ValueError, match="split"):
        generate("validation", 1)


def test_ids_rebuild_the_same_instance():
    for task in generate("heldout", 6, seed=2) + generate("train", 3, difficulty=2):
        assert _key(instance_from_id(task.id)) == _key(task)
    with pytest.raises(ValueError):
        instance_from_id("fix_bug/test/1")


def test_all_difficulties_occur_and_can_be_forced():
    levels = collections.Counter(t.difficulty for t in generate("train", 60))
    assert set(levels) == {1, 2, 3}
    assert {t.difficulty for t in generate("train", 12, difficulty=3)} == {3}


def test_held_out_phrasings_kernels_and_domains_never_appear_in_training():
    heldout_kernels = {k.key for k in KERNELS if k.heldout}
    heldout_domains = {d.key for d in DOMAINS if d.heldout}
    train = generate("train", 240, seed=7)
    for t in train:
        assert t.meta["phrase"][1] is False, t.id
        assert heldout_kernels.isdisjoint(t.meta["kernels_used"]), t.id
        assert t.meta["domain"] not in heldout_domains, t.id
    heldout = generate("heldout", 120, seed=7)
    assert all(t.meta["phrase"][1] for t in heldout)
    assert any(heldout_kernels & set(t.meta["kernels_used"]) for t in heldout)
    assert any(t.meta["domain"] in heldout_domains for t in heldout)


def test_composed_phrasings_change_only_the_words_of_training_tasks():
    composed = generate("train", 120, seed=4, phrasings=0.6)
    fixed = generate("train", 120, seed=4)
    heldout = generate("heldout", 30, seed=4)
    phrasings = {f: m.TRAIN_PHRASINGS for f, m in _FAMILY_MODULES.items()}
    for family, texts in phrasings.items():         # each carries facts of the task
        assert texts and all(re.search(r"{\w+}", v) for v in texts), family
    assert [_key(t) for t in generate("heldout", 30, seed=4, phrasings=1.0)] == \
        [_key(t) for t in heldout]
    changed = 0
    for a, b in zip(composed, fixed):
        assert (a.files, a.hidden_tests, a.solution) == (b.files, b.hidden_tests, b.solution)
        if a.instruction != b.instruction:
            changed += 1
            assert a.meta["phrase"][0] >= len(_FAMILY_MODULES[a.family].PHRASES), a.id
            assert a.meta["phrase"][1] is False, a.id
            variant = phrasings[a.family][a.meta["phrase"][0]
                                          - len(_FAMILY_MODULES[a.family].PHRASES)]
            assert max(re.split(r"{\w+}", variant), key=len) in a.instruction, a.id
    assert 40 <= changed <= 100                     # about 60 % of them
    texts = {p.text.split("{")[0] for m in _FAMILY_MODULES.values() for p in m.PHRASES
             if p.heldout}
    for t in composed:                              # no held-out sentence opens a composed one
        assert not any(x and x in t.instruction for x in texts if len(x) > 12), t.id


def test_surface_forms_vary_within_a_family():
    for family in FAMILIES:
        tasks = generate("train", 30, seed=11, families=[family])
        assert len({t.meta["phrase"][0] for t in tasks}) >= 3, family
        assert len({t.meta["package"] for t in tasks}) >= 8, family
        assert len({t.meta["domain"] for t in tasks}) >= 5, family
        layouts = {tuple(sorted(p for p in t.files if p.endswith(".py"))) for t in tasks}
        assert len(layouts) >= 20, family


def test_hidden_tests_are_not_in_the_workspace_and_solutions_are_not_in_the_files(tmp_path):
    for task in generate("train", 18, seed=5):
        assert task.hidden_tests and set(task.hidden_tests).isdisjoint(task.files)
        assert all(p.startswith("tests/") for p in task.hidden_tests)
        task.materialize(tmp_path / task.id)
        on_disk = {p.relative_to(tmp_path / task.id).as_posix()
                   for p in (tmp_path / task.id).rglob("*") if p.is_file()}
        assert on_disk == set(task.files)
        assert not any("acceptance" in content for content in task.files.values())


def test_every_planted_bug_is_visible_on_some_generated_input():
    rng = Random(0)
    from learner.tasks.repo import Context
    for kernel in KERNELS:
        for bug in kernel.bugs:
            ctx = Context(rng, "heldout", 1, domain=next(
                d for d in DOMAINS if not kernel.domains or d.key in kernel.domains))
            func = ctx.func(kernel)
            good, bad = func.sub(bug.old), func.sub(bug.new)
            assert func.code.count(good) == 1, (kernel.key, bug)
            bad_code = func.code.replace(good, bad)
            cases = ctx.cases(func, 6)
            assert cases and all(r[0] == "ok" for _, r in cases), kernel.key
            assert any(differs(r, outcome(func.body(bad_code), func.name, a))
                       for a, r in cases), (kernel.key, bug.kind)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_starting_repository_fails_its_hidden_tests(family, tmp_path):
    for task in generate("train", 2, seed=9, families=[family]) + \
            generate("heldout", 1, seed=9, families=[family]):
        workspace = tmp_path / task.id
        task.materialize(workspace)
        result = grade(task, workspace)
        assert not result.passed and not result.cheated and result.reward == 0, \
            (task.id, result.detail)


def test_generation_is_fast():
    import time
    start = time.perf_counter()
    generate("train", 300, seed=1)
    assert time.perf_counter() - start < 10


def test_retry_is_exported_for_family_authors():
    assert issubclass(Retry, Exception)
    assert make_instance("fix_bug", "train", 0).id == "fix_bug/train/0"
