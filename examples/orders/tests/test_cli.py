import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_prints_the_total_of_the_data_file():
    out = subprocess.run([sys.executable, "-m", "orders.cli", "data/today.csv"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "total quantity: 42\n"
