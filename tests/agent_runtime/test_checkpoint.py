"""Loading and saving Hugging Face MoE checkpoints."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent_runtime.model import CheckpointError, ConfigError, load_model, save_model
from tiny_checkpoints import FAMILIES, VOCAB, make_hf_model, save_hf_checkpoint

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_round_trips_through_transformers(family, tmp_path):
    ours = load_model(save_hf_checkpoint(family, tmp_path / "hf"), dtype="float32")
    save_model(ours, tmp_path / "ours")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ref(IDS).logits, ref(IDS).logits)
        assert (ref(IDS).logits - ours(IDS).logits).abs().max().item() < 1e-4
    # the same tensor names and values as the checkpoint transformers wrote
    theirs = load_file(str(tmp_path / "hf" / "model.safetensors"))
    mine = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    ours = load_model(save_hf_checkpoint("qwen2_moe", tmp_path / "hf"))
    save_model(ours, tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = load_model(tmp_path / "sharded")
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, again(IDS).logits)


def test_fused_3d_expert_tensors_load(tmp_path):
    """transformers-5-style `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]."""
    src = save_hf_checkpoint("qwen3_moe", tmp_path / "hf")
    model = load_model(src)
    state = load_file(str(src / "model.safetensors"))
    a = model.args
    for i in range(a.num_layers):
        p = f"model.layers.{i}.mlp.experts"
        gu = torch.stack([torch.cat([state.pop(f"{p}.{e}.gate_proj.weight"), state.pop(f"{p}.{e}.up_proj.weight")])
                          for e in range(a.num_experts)])
        dn = torch.stack([state.pop(f"{p}.{e}.down_proj.weight") for e in range(a.num_experts)])
        state[f"{p}.gate_up_proj"], state[f"{p}.down_proj"] = gu, dn
    save_file(state, str(src / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(load_model(src)(IDS).logits, model(IDS).logits)


def test_bfloat16_load_casts_every_weight(tmp_path):
    model = load_model(save_hf_checkpoint("olmoe", tmp_path), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits.float()).all()


def test_tied_embeddings_share_one_tensor(tmp_path):
    model = load_model(save_hf_checkpoint("mixtral", tmp_path))
    assert model.lm_head.weight is model.embed_tokens.weight
    save_model(model, tmp_path / "out")
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))


def test_missing_tensor_is_named(tmp_path):
    src = save_hf_checkpoint("mixtral", tmp_path)
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight"):
        load_model(src)


def test_shape_mismatch_is_named(tmp_path):
    src = save_hf_checkpoint("granitemoe", tmp_path)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight.*\(3, 3\)"):
        load_model(src)


def test_unsupported_model_type_is_named(tmp_path):
    src = save_hf_checkpoint("olmoe", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        load_model(src)


def test_load_peak_memory_stays_near_checkpoint_size(tmp_path):
    """Peak RSS growth while loading a per-expert checkpoint stays under 1.3x its size."""
    src = tmp_path / "big"
    make_hf_model("qwen2_moe", hidden_size=256, moe_intermediate_size=256, num_experts=32,
                  shared_expert_intermediate_size=256, intermediate_size=256,
                  num_hidden_layers=4, vocab_size=512).save_pretrained(src)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    code = textwrap.dedent(f"""
        import resource, torch, sys
        from agent_runtime.model import load_model
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model = load_model({str(src)!r})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
    """)
    # warm-up of torch's own allocations happens before `before` (import + a tiny tensor op)
    grown = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout.split()[-1])
    assert size > 30e6
    assert grown < 1.3 * size, f"peak RSS grew {grown / 1e6:.1f} MB for a {size / 1e6:.1f} MB checkpoint"


def test_a_load_builds_on_meta_without_importing_torch_dynamo(tmp_path):
    """A meta tensor's normal_ or arange imports torch._dynamo (~3 s of every `apprentice`
    process that loads a model); a load skips them, a model built for training keeps its init."""
    path = save_hf_checkpoint("qwen3_moe", tmp_path / "hf")
    code = textwrap.dedent(f"""
        import sys, torch
        from agent_runtime.model import load_model
        model = load_model({str(path)!r})
        assert model.embed_tokens.weight.device.type == "cpu"
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False", out.stderr
    from agent_runtime.model.model import MoEModel, rope_frequencies
    model = load_model(path, dtype="float32")
    assert torch.equal(model.inv_freq, rope_frequencies(model.args))
    torch.manual_seed(0)
    built = MoEModel(model.args)                    # as nn.Embedding initializes: N(0, 1)
    torch.manual_seed(0)
    assert torch.equal(built.embed_tokens.weight, torch.randn(built.embed_tokens.weight.shape))
    assert torch.equal(built.inv_freq, rope_frequencies(model.args))
