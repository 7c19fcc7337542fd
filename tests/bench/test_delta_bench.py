"""bench/delta.py's real-update mode on a tiny checkpoint: the GRPO step it measures really
changes the published weights, and the codec carries that change over bit-exactly."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "agent_runtime"))
from tiny_checkpoints import save_tiny_agent_checkpoint  # noqa: E402

from agent_runtime import delta  # noqa: E402


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_delta", ROOT / "bench" / "delta.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_real_grpo_update_changes_the_state_and_round_trips(tmp_path):
    bench = load_bench()
    ckpt = save_tiny_agent_checkpoint(tmp_path / "ckpt")
    args = argparse.Namespace(warmup=1, updates=1, groups=2, group_size=3, new_tokens=6, seed=0,
                              settled=True)
    ((label, old, new),) = list(bench.real_updates(ckpt, 1e-3, args, tmp_path / "run"))
    assert "step 2" in label
    assert delta.state_sha256(old) != delta.state_sha256(new)
    row = bench.measure(label, old, new, delta.ZSTD_LEVEL)        # asserts the round trip
    assert float(row["ratio"].rstrip("x")) > 1


def test_settled_masters_publish_the_same_bf16_weights():
    bench = load_bench()
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())                     # on the bf16 grid, as loaded
        model.bias[:4] = torch.tensor([0.0, -0.0, float("inf"), -3.0e38])
    before = {k: v.bfloat16().view(torch.int16).clone() for k, v in model.state_dict().items()}
    bench.settle(model)
    for k, v in model.state_dict().items():
        assert torch.equal(v.bfloat16().view(torch.int16), before[k]), k
    assert (model.weight != model.weight.bfloat16().float()).float().mean() > 0.99
