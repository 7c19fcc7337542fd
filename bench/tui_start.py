"""How long `apprentice` takes to become interactive in a real terminal (tmux).

For each policy (`--policy replay:FILE`, and the default policy through bare `apprentice`)
it starts the TUI in a detached tmux session on a private socket, on a throwaway workspace
and $APPRENTICE_HOME, and measures from launch:

- first frame: the chat input is on screen;
- interactive: a probe typed into the terminal shows up in the input (keys are handled);
- settled: the footer names the loaded policy with its version, or says why there is none
  (no default model is shipped yet; that message counts).

It also checks that the screen shows the workspace and the model. The target is
interactive within 2 s. Needs tmux.

    python bench/tui_start.py [--runs 3] [--timeout 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 2.0
SIZE = (120, 36)
PROBE = "zqprobe"
SCRIPT = ["Nothing to do.\n<tool_call>\n"
          '{"name": "finish", "arguments": {"summary": "nothing to do"}}\n</tool_call>']


def apprentice_command() -> list[str]:
    script = Path(sys.executable).parent / "apprentice"
    return [str(script)] if script.exists() else [sys.executable, "-m", "agent_runtime.cli"]


class Tmux:
    """A tmux server of our own (private socket), so nothing else is touched."""

    def __init__(self) -> None:
        self.socket = f"apprentice-bench-{os.getpid()}-{time.monotonic_ns()}"

    def __call__(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                             text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"tmux {args[0]} failed: {out.stderr.strip()}")
        return out.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "bench", check=False)

    def kill(self) -> None:
        self("kill-server", check=False)


def measure(case: str, command: list[str], cwd: Path, env: dict[str, str],
            timeout: float) -> dict:
    tmux = Tmux()
    shell = " ".join(_quote(a) for a in command)
    try:
        start = time.perf_counter()
        tmux("new-session", "-d", "-s", "bench", "-x", str(SIZE[0]), "-y", str(SIZE[1]),
             "-c", str(cwd), "-e", f"APPRENTICE_HOME={env['APPRENTICE_HOME']}", shell)
        times: dict[str, float] = {}
        sent = False
        screen = ""
        while time.perf_counter() - start < timeout:
            screen = tmux.screen()
            now = time.perf_counter() - start
            if "first_frame" not in times and "Ask apprentice" in screen:
                times["first_frame"] = now
            if "first_frame" in times and not sent:
                tmux("send-keys", "-t", "bench", "-l", PROBE)
                sent = True
            if sent and "interactive" not in times and PROBE in screen:
                times["interactive"] = now
            if "settled" not in times and _settled(screen):
                times["settled"] = now
            if len(times) == 3:
                break
            time.sleep(0.01)
        result = {"case": case, **{k: round(v, 3) for k, v in times.items()},
                  "shows_workspace": cwd.name in screen,
                  "shows_model": "model " in screen or "model:" in screen,
                  "footer": _footer(screen)}
        if len(times) < 3:
            result["error"] = f"timed out after {timeout:g} s; last screen:\n{screen}"
        tmux("send-keys", "-t", "bench", "C-q", check=False)
        return result
    finally:
        tmux.kill()


def _settled(screen: str) -> bool:
    footer = _footer(screen)
    return ("model: none" in footer) or (" · v" in footer and "loading" not in footer)


def _footer(screen: str) -> str:
    return next((line.strip() for line in screen.splitlines() if "learner" in line), "")


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="starts per case")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per start")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("tmux is not installed")
    results = []
    with tempfile.TemporaryDirectory(prefix="tui-start-") as tmp:
        root = Path(tmp)
        workspace = root / "calc"
        workspace.mkdir()
        (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        script = root / "script.json"
        script.write_text(json.dumps(SCRIPT))
        env = {"APPRENTICE_HOME": str(root / "home")}
        cases = {
            "replay": apprentice_command() + ["tui", "--policy", f"replay:{script}"],
            "default": apprentice_command(),           # bare `apprentice`, default policy
        }
        for case, command in cases.items():
            for _ in range(args.runs):
                results.append(measure(case, command, workspace, env, args.timeout))
    report = {"target_s": TARGET_S, "runs": results, "summary": {}}
    for case in ("replay", "default"):
        runs = [r for r in results if r["case"] == case and "interactive" in r]
        if runs:
            report["summary"][case] = {
                key: {"median": round(statistics.median(r[key] for r in runs), 3),
                      "max": round(max(r[key] for r in runs), 3)}
                for key in ("first_frame", "interactive", "settled")}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for r in results:
        if "error" in r:
            print(f"{r['case']:8} ERROR {r['error']}")
            continue
        verdict = "ok" if r["interactive"] <= TARGET_S else "SLOW"
        print(f"{r['case']:8} first frame {r['first_frame']:6.3f} s  interactive "
              f"{r['interactive']:6.3f} s  settled {r['settled']:6.3f} s  [{verdict}]  "
              f"workspace shown: {r['shows_workspace']}  footer: {r['footer']}")
    for case, s in report["summary"].items():
        print(f"{case:8} median interactive {s['interactive']['median']:.3f} s "
              f"(max {s['interactive']['max']:.3f} s; target {TARGET_S:g} s)")


if __name__ == "__main__":
    main()
