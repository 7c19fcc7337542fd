"""`apprentice tui` (and bare `apprentice`): the same policy options as `apprentice run`."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from agent_runtime.cli import main
from tui.app import ApprenticeApp


@pytest.fixture
def launched(monkeypatch):
    seen = []
    monkeypatch.setattr(ApprenticeApp, "run", lambda self: seen.append(self.settings))
    return seen


def test_tui_command_has_help_and_the_run_options():
    out = CliRunner().invoke(main, ["tui", "--help"]).output
    for option in ("-w, --workspace", "--model", "--policy", "--max-steps", "--approval"):
        assert option in out


def test_tui_passes_the_options_to_the_app(launched, workspace, tmp_path):
    script = tmp_path / "x.json"
    script.write_text("[]")
    spec = f"replay:{script}"
    result = CliRunner().invoke(main, ["tui", "-w", str(workspace), "--policy", spec,
                                       "--max-steps", "3", "--approval", "auto-edit"])
    assert result.exit_code == 0, result.output
    (settings,) = launched
    assert (settings.workspace, settings.spec, settings.max_steps, settings.approval) == \
        (workspace.resolve(), spec, 3, "auto-edit")


def test_tui_refuses_a_replay_script_that_does_not_exist(launched, workspace, tmp_path):
    result = CliRunner().invoke(main, ["tui", "-w", str(workspace), "--policy",
                                       f"replay:{tmp_path / 'missing.json'}"])
    assert result.exit_code == 1 and "does not exist" in result.output and not launched


def test_bare_apprentice_opens_the_tui_on_the_current_directory(launched, workspace,
                                                               monkeypatch):
    monkeypatch.chdir(workspace)
    result = CliRunner().invoke(main, [])
    assert result.exit_code == 0, result.output
    assert launched[0].workspace == Path.cwd().resolve() and launched[0].spec == "default"
