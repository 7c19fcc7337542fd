"""A pytest plugin for apprentice's evaluations (`learner.tasks.grading.fixed_clock`): pytest's
clock stands still, so a run reports its duration as 0 ("1 passed in 0.00s") whatever it
took, and two evaluations of one model print the same tool output. Loaded by name through
PYTEST_PLUGINS, it replaces the functions pytest reads its time from (`_pytest.timing`, which
pytest's own tests mock the same way); the tests under it see the real clock."""

from _pytest import timing

timing.perf_counter = lambda: 0.0
timing.time = lambda: 0.0
