"""heap.trim: glibc's free pages handed back, or nothing where there is no glibc."""

import os
import subprocess
import sys

CHECK = "from agent_runtime.model.heap import trim; print(trim(), trim())"


def run(env_extra):
    env = {k: v for k, v in os.environ.items() if k != "APPRENTICE_BOUND_HEAP"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                          text=True, check=True).stdout.split()


def test_trim_runs_on_glibc_and_can_be_turned_off():
    import platform
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert run({}) == [str(glibc)] * 2
    assert run({"APPRENTICE_BOUND_HEAP": "0"}) == ["False", "False"]
