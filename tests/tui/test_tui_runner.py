"""Settings to policy, display names, and following learner versions between model calls."""

import json

from tui import runner
from tui.runner import Settings


def test_replay_spec_loads_the_scripted_policy(tmp_path):
    script = tmp_path / "s.json"
    script.write_text(json.dumps(["hi"]))
    policy, error = runner.load(Settings(policy_spec=f"replay:{script}", context_window=4096))
    assert error is None and policy.name == f"replay:{script}" and policy.context_window == 4096


def test_missing_default_model_becomes_a_message(monkeypatch):
    def load_policy(spec):
        raise FileNotFoundError("no default model at X")

    monkeypatch.setattr("agent_runtime.policies.loading.load_policy", load_policy)
    policy, error = runner.load(Settings())
    assert policy is None and error.startswith(runner.NO_DEFAULT_MODEL)


def test_broken_script_becomes_a_message(tmp_path):
    script = tmp_path / "s.json"
    script.write_text("{}")
    policy, error = runner.load(Settings(policy_spec=f"replay:{script}"))
    assert policy is None and "ValueError" in error


def test_display_names_leave_out_directories():
    assert runner.display_name("replay:/a/b/fix.json") == "replay:fix.json"
    assert runner.display_name("/models/qwen-moe/") == "qwen-moe"
    assert runner.display_name("default") == "default"


def test_short_path_writes_home_as_tilde(tmp_path):
    assert runner.short_path(tmp_path / "calc") == "~/calc"      # HOME is tmp_path here
    assert runner.short_path("/elsewhere") == "/elsewhere"


class FakeSubscriber:
    status, sha256 = "v1 · up to date", "ab" * 32

    def __init__(self, staged):
        self.staged = staged

    def poll_swap(self, apply):
        if self.staged is None:
            return None
        patch, self.staged = self.staged, None
        apply(patch)
        return patch.to_version


def test_learner_status_reads_the_subscriber():
    assert runner.learner_status(Settings(), object(), None) == "off"
    assert runner.learner_status(Settings(connect="http://x:1"), object(), FakeSubscriber(None)) \
        == "v1 · up to date"
    assert "needs a model" in runner.learner_status(Settings(connect="http://x:1"), object(), None)
