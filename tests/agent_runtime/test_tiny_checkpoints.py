"""The tiny checkpoints every engine, policy and learner test builds are the same on every run
and machine: their tokenizer's ids and their weights are fingerprinted here, so a change of
`TOKENIZER_CORPUS`, of the drawing of the weights, or of the pinned `transformers` /
`tokenizers` (pyproject's dev extra) shows up as this one failure, not as drift in many tests.
After an intended change, run this file and replace the fingerprint it prints."""

import hashlib
import json

import torch
from safetensors.torch import load_file
from tiny_checkpoints import save_tiny_agent_checkpoint

VOCAB_SHA256 = "c49085421ac50fe9c23a676e4694b0736d934eab278e696fc6b9d7cae5b55a51"
WEIGHTS_SHA256 = "7ca192b67eeab88617bfd01c2f4791359bb5653665e97f62b0952ee39fc6248f"


def fingerprints(path):
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    ids = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]))
    weights = hashlib.sha256()
    state = load_file(path / "model.safetensors")
    for name in sorted(state):          # to 1e-4: the draw and the layout, not the last bit
        weights.update(name.encode())
        weights.update((state[name].float() * 1e4).round().to(torch.int64).numpy().tobytes())
    return hashlib.sha256(ids.encode()).hexdigest(), weights.hexdigest()


def test_the_tiny_agent_checkpoint_is_the_same_everywhere(tmp_path):
    vocab, weights = fingerprints(save_tiny_agent_checkpoint(tmp_path / "ckpt"))
    assert vocab == VOCAB_SHA256, f"the tokenizer's ids changed: {vocab}"
    assert weights == WEIGHTS_SHA256, f"the weights changed: {weights}"
