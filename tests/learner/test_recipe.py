"""The default-model recipe at toy scale: BPE training, pre-training, SFT data, resume."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from agent_runtime.model import load_model, load_tokenizer, save_model
from agent_runtime.model.chat_template import DEFAULT_CHAT_TEMPLATE
from agent_runtime.model.tokenizer import DEFAULT_PAT_STR
from learner import tasks as sim
from learner.recipe import tokenizer_stage as ts
from learner.recipe.lm import LMConfig, train_lm
from learner.recipe.pretrain import (ModelShape, PretrainConfig, init_model, window_batches,
                                     copy_window, with_repeats)
from learner.recipe.sft import _episodes_only, copy_sequences, merge_samples

CODE = "".join(Path(m.__file__).read_text() for m in (json, random, ts))
TINY = ModelShape(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                  num_experts=8, top_k=2, expert_size=32, max_position=512)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    ranks = ts.train_bpe(ts.word_counts([CODE]), 200)
    return ts.save_tokenizer(ts.build_tokenizer(ranks), out, DEFAULT_CHAT_TEMPLATE)


def reference_bpe(counts: Counter, n_merges: int) -> list[bytes]:
    """Textbook BPE: recount every pair after every merge (slow, obviously right)."""
    words = {tuple(bytes([b]) for b in w): c for w, c in counts.items() if 1 < len(w) <= ts.MAX_WORD_BYTES}
    learned: list[bytes] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs.values())
        a, b = min(p for p, c in pairs.items() if c == best)        # ties: lowest bytes first
        if a + b not in learned:
            learned.append(a + b)
        merged = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return learned


def test_bpe_matches_reference_trainer():
    counts = ts.word_counts([Path(json.__file__).read_text()[:6000]])
    ranks = ts.train_bpe(counts, 60)
    learned = [t for t, r in sorted(ranks.items(), key=lambda kv: kv[1]) if r >= 256]
    ref = reference_bpe(counts, 60)
    assert learned == ref[:len(learned)] and len(learned) >= 55


def test_tokenizer_round_trips_and_reloads(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = CODE[:3000] + "\n# ünïcode ✓ \x00 tabs\t\tend"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5            # merges compress code
    for marker in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(marker)) == 1
    assert tok.eos_token_id == tok.encode("<|im_end|>")[0]
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == DEFAULT_CHAT_TEMPLATE and config["eos_token"] == "<|im_end|>"


def test_corpus_split_is_by_file_and_stable():
    names = [f"stdlib/pkg/mod{i}.py" for i in range(2000)]
    held = [n for n in names if ts.is_heldout(n, 2)]
    assert 10 < len(held) < 80
    assert held == [n for n in names if ts.is_heldout(n, 2)]


def _tiny_model(tok_dir: Path, seed: int = 0):
    return init_model(TINY, load_tokenizer(tok_dir), seed)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pretraining_lowers_the_loss(tok_dir, tmp_path, precision):
    tok = load_tokenizer(tok_dir)
    data = np.asarray(tok.encode(CODE), dtype=np.uint16)
    model = _tiny_model(tok_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = LMConfig(steps=12, lr=1e-2, warmup=2, log_every=4, checkpoint_every=12,
                   precision=precision)
    result = train_lm(model, window_batches(data, 32, 4, 0), cfg, tmp_path / "state", log=lambda r: None)
    losses = [r["loss"] for r in result["history"]]
    assert result["bf16"] == (precision == "bf16")
    assert losses[-1] < losses[0] - 0.5
    assert all(not torch.equal(before[k], v) for k, v in model.state_dict().items()
               if k.endswith(("experts.gate_up", "embed_tokens.weight")))
    # the trained weights are the fp32 masters, finer than the bf16 copy the steps ran on
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(p, p.bfloat16().float()) for p in model.parameters())


def test_bf16_training_follows_fp32(tok_dir, tmp_path):
    """The bf16 working copy computes the same training as fp32, up to bf16 rounding."""
    data = np.asarray(load_tokenizer(tok_dir).encode(CODE), dtype=np.uint16)
    runs = {}
    for precision in ("fp32", "bf16"):
        model = _tiny_model(tok_dir)
        cfg = LMConfig(steps=8, lr=5e-3, warmup=2, log_every=1, checkpoint_every=8,
                       precision=precision)
        result = train_lm(model, window_batches(data, 32, 4, 0), cfg, tmp_path / precision,
                          log=lambda r: None)
        runs[precision] = [r["loss"] for r in result["history"]]
    assert runs["fp32"] != runs["bf16"]                        # it did run in bf16
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert abs(a - b) < 0.05 * a


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_resumes_exactly(tok_dir, tmp_path, precision):
    data = np.asarray(load_tokenizer(tok_dir).encode(CODE), dtype=np.uint16)
    batch = window_batches(data, 32, 4, 0)
    cfg = LMConfig(steps=6, lr=5e-3, warmup=1, log_every=2, checkpoint_every=2,
                   precision=precision)
    straight = _tiny_model(tok_dir)
    train_lm(straight, batch, cfg, tmp_path / "a", log=lambda r: None)

    def killed_at_4(step):
        if step == 4:
            raise KeyboardInterrupt                           # the process dies here
        return batch(step)
    with pytest.raises(KeyboardInterrupt):
        train_lm(_tiny_model(tok_dir), killed_at_4, cfg, tmp_path / "b", log=lambda r: None)
    seen = []
    again = _tiny_model(tok_dir, seed=1)                     # weights come from the state file
    train_lm(again, batch, cfg, tmp_path / "b", log=seen.append)
    assert any(r.get("resumed_at") == 4 for r in seen)
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v)


def test_sft_mask_covers_only_completions():
    eos = 99
    samples = [
        {"prompt_ids": [1, 2, 3], "completion_ids": [10, 11], "finish_reason": "stop"},
        {"prompt_ids": [1, 2, 3, 10, 11, eos, 4, 5], "completion_ids": [12, eos], "finish_reason": "eos"},
        {"prompt_ids": [1, 7], "completion_ids": [13], "finish_reason": "length"},   # new segment
    ]
    seqs, merged = merge_samples(samples, eos)
    assert merged == 1
    (ids, mask), (ids2, mask2) = seqs
    assert ids == [1, 2, 3, 10, 11, eos, 4, 5, 12, eos]
    assert [t for t, m in zip(ids, mask) if m] == [10, 11, eos, 12, eos]
    assert [t for t, m in zip(ids2, mask2) if m] == [13]         # cut off: no eos added


def test_sft_data_comes_from_the_real_agent_loop(tok_dir, tmp_path, monkeypatch):
    from learner.recipe import sft
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    out = sft._collect_chunk(sft.Chunk(str(tok_dir), [1], [10**6]))    # no summaries
    assert out["passed"] == 1 and out["seqs"]
    tok = load_tokenizer(tok_dir)
    ids, mask = out["seqs"][0]
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    prompt = tok.decode(ids[:mask.index(1)])
    assert prompt.startswith("<|im_start|>system\nYou are apprentice") and "<tools>" in prompt
    assert trained.count("<|im_end|>") == trained.count("<tool_call>") >= 2
    assert '"name": "finish"' in trained and "<tool_response>" not in trained


def test_code_numbers_are_the_code_writing_families_in_turn():
    from learner.recipe.sft import CODE_FAMILIES, code_numbers
    numbers = code_numbers(7)
    families = [t.family for t in sim.generate("train", max(numbers) + 1)]
    picked = [families[j] for j in numbers]
    assert len(numbers) == len(set(numbers)) == 7 and set(picked) == set(CODE_FAMILIES)
    assert [f for f in families if f in CODE_FAMILIES] == picked      # none skipped


def test_heldout_episodes_come_from_the_heldout_split(tok_dir, monkeypatch):
    from learner.recipe import sft
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    tok = load_tokenizer(tok_dir)
    texts = {split: tok.decode(list(sft._collect_chunk(sft.Chunk(str(tok_dir), [0], [10**6],
                                                                  split=split))["seqs"][0][0]))
             for split in ("train", "heldout")}
    tasks = {split: sim.generate(split, 1)[0].instruction for split in ("train", "heldout")}
    assert tasks["train"] != tasks["heldout"]
    assert all(tasks[split] in texts[split] for split in texts)


def test_assistant_metrics_score_the_trained_tokens_and_whole_turns(tok_dir):
    from learner.recipe.sft import assistant_metrics
    model = init_model(TINY, load_tokenizer(tok_dir), seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (12,), generator=g).numpy()
    mask = np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1], dtype=np.uint8)     # 3 turns
    with torch.no_grad():
        logits = model(torch.from_numpy(ids[None, :-1].astype(np.int64))).logits[0]
    at = torch.from_numpy(mask[1:].astype(bool))
    target = torch.from_numpy(ids[1:].astype(np.int64))[at]
    hit = logits[at].argmax(-1) == target
    got = assistant_metrics(model, [(ids, mask)])
    assert got["tokens"] == 6 and got["turns"] == 3
    assert got["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits[at], target)),
                                        rel=1e-5)
    assert got["token_accuracy"] == pytest.approx(float(hit.float().mean()))
    # make the model right everywhere but one token of the second turn: one turn of three fails
    class RightButOne(torch.nn.Module):
        def forward(self, x, logits_at):
            out = torch.full((int(logits_at.sum()), 200), -9.0)
            out[torch.arange(len(target)), target] = 9.0
            out[3, (int(target[3]) + 1) % 200] = 99.0
            return type("Out", (), {"logits": out})()
    perfect = assistant_metrics(RightButOne(), [(ids, mask)])
    assert perfect["token_accuracy"] == pytest.approx(5 / 6)
    assert perfect["turns_exact"] == pytest.approx(2 / 3)


def test_a_skipped_sample_stays_as_context_but_is_not_trained_on():
    eos = 99
    samples = [
        {"prompt_ids": [1, 2], "completion_ids": [10, eos], "finish_reason": "eos"},
        {"prompt_ids": [1, 2, 10, eos, 3], "completion_ids": [11, eos], "finish_reason": "eos"},
    ]
    (ids, mask), = merge_samples(samples, eos, [True, False])[0]
    assert ids == [1, 2, 10, eos, 3, 11, eos]
    assert [t for t, m in zip(ids, mask) if m] == [11, eos]


def test_a_slip_garbles_one_call_and_the_turn_after_it_recovers():
    from agent_runtime.toolcalls import parse_tool_calls
    from learner.recipe.sft import with_slip
    from learner.tasks.oracle import render_turn
    turns = [render_turn("Reading.", [{"name": "read_file", "arguments": {"path": "pkg/mod.py"}}]),
             render_turn("Fixing.", [{"name": "edit_file", "arguments": {
                 "path": "pkg/mod.py", "old": "return a - b", "new": "return a + b"}}]),
             render_turn("Done.", [{"name": "finish", "arguments": {"summary": "ok"}}])]
    seen = set()
    for seed in range(20):
        out, slips = with_slip(turns, random.Random(seed))
        assert len(out) == 4 and len(slips) == 1
        i = next(j for j, t in enumerate(out) if t in slips)
        slip, = parse_tool_calls(out[i]).calls
        fixed = parse_tool_calls(out[i + 1]).calls
        planned = parse_tool_calls(turns[i]).calls                # the recovery is the plan's call
        assert [(c.name, c.arguments) for c in fixed] == [(c.name, c.arguments) for c in planned]
        field = "old" if slip.name == "edit_file" else "path"
        assert slip.name == fixed[0].name and slip.arguments[field] != fixed[0].arguments[field]
        assert abs(len(slip.arguments[field]) - len(fixed[0].arguments[field])) == 1
        assert not out[i + 1].startswith(out[i].split("<tool_call>")[0])   # a new sentence
        assert out[:i] + out[i + 2:] == turns[:i] + turns[i + 1:]
        seen.add(slip.name)
    assert seen == {"read_file", "edit_file"}
    finish_only = turns[2:]
    assert with_slip(finish_only, random.Random(0)) == (finish_only, set())


def test_slipped_episodes_pass_and_mask_the_slip(tok_dir, monkeypatch):
    from learner.recipe import sft
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    # tasks 1 and 3: implement_function and fix_import (a rename reads nothing and makes no
    # edit_file call, so it has no turn to slip on)
    out = sft._collect_chunk(sft.Chunk(str(tok_dir), [1, 3], [10**6] * 2, slipped=[1, 3]))
    assert out["passed"] == 2 and out["slips"] == 2
    tok = load_tokenizer(tok_dir)
    for ids, mask in out["seqs"]:
        text = tok.decode(ids)
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        assert "does not exist" in text or "was not found" in text     # the tool saw the slip
        assert text.count("<|im_start|>assistant") == trained.count("<|im_end|>") + 1


def test_misfix_plays_the_fix_with_a_typo_then_the_check_then_the_repair():
    from agent_runtime.toolcalls import parse_tool_calls
    from learner.recipe.sft import MISFIX_SAY, with_misfix
    from learner.tasks.oracle import script
    task = next(t for t in sim.generate("train", 12) if t.family == "fix_command")
    turns = script(task)
    out, skipped, wrong = with_misfix(turns, random.Random(0))
    assert len(out) == len(turns) + 2 and len(skipped) == 1
    i = out.index(next(iter(skipped)))
    fix, = parse_tool_calls(turns[i]).calls
    typo, = parse_tool_calls(out[i]).calls
    assert typo.name == "edit_file" and typo.arguments == wrong["arguments"]
    assert typo.arguments["old"] == fix.arguments["old"]
    assert abs(len(typo.arguments["new"]) - len(fix.arguments["new"])) == 1
    assert out[i + 1] == turns[i + 1]                       # the check, then the repair
    repair, = parse_tool_calls(out[i + 2]).calls
    assert out[i + 2].split("\n", 1)[0] in MISFIX_SAY
    assert repair.arguments == {"path": fix.arguments["path"], "old": typo.arguments["new"],
                                "new": fix.arguments["new"]}
    assert out[:i] == turns[:i] and out[i + 3:] == turns[i + 1:]
    rename = next(t for t in sim.generate("train", 12) if t.family == "rename_symbol")
    assert with_misfix(script(rename), random.Random(0)) == (script(rename), set(), None)


def test_misfixed_episodes_see_the_check_fail_and_train_only_the_repair(tok_dir, monkeypatch):
    from learner.recipe import sft
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    families = [t.family for t in sim.generate("train", 6)]
    numbers = [families.index("fix_bug"), families.index("fix_command"),
               families.index("rename_symbol")]
    out = sft._collect_chunk(sft.Chunk(str(tok_dir), numbers, [10**6] * 3, misfixed=numbers))
    assert out["passed"] == 3 and out["misfixes"] + out["misfix_dropped"] == 2
    assert out["misfixes"] >= 1 and out["slips"] == 0
    tok = load_tokenizer(tok_dir)
    repaired = 0
    for ids, mask in out["seqs"]:
        text = tok.decode(ids)
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        if any(say in trained for say in sft.MISFIX_SAY):
            repaired += 1
            assert re.search(r"\[exit code: [1-9]", text)      # the check saw the typo fail
            assert text.count("<|im_start|>assistant") == trained.count("<|im_end|>") + 1
        else:
            assert text.count("<|im_start|>assistant") == trained.count("<|im_end|>")
    assert repaired == out["misfixes"]


def test_repeated_spans_copy_the_window_itself_and_are_fixed_by_the_step():
    row = torch.arange(1000, 1300)
    out = with_repeats(row, torch.Generator().manual_seed(3))
    assert torch.equal(out, with_repeats(row, torch.Generator().manual_seed(3)))
    changed = (out != row).nonzero()[:, 0].tolist()
    assert changed                                  # arange has no repeats of its own
    # a changed position holds a token from earlier in the window (the source of its span)
    assert all(int(out[p]) - 1000 < p for p in changed)
    assert len(changed) >= 16                       # at least one whole span
    data = np.arange(5000, dtype=np.uint16)
    plain, mixed = window_batches(data, 256, 8, 0), window_batches(data, 256, 8, 0, repeat_share=1.0)
    x, y, _ = mixed(7)
    assert torch.equal(x[:, 1:], y[:, :-1])         # targets stay the inputs shifted by one
    assert not torch.equal(x, plain(7)[0]) and torch.equal(mixed(7)[0], x)


def test_copy_windows_train_only_on_second_copies_of_their_spans():
    data = np.arange(5000, dtype=np.uint16)
    x, y, mask = window_batches(data, 512, 4, 0, copy_share=1.0)(3)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for m in mask:
        assert 0 < int(m.sum()) < len(m)            # first copies are not trained
    row, m = copy_window(torch.arange(100, 5000), 700, torch.Generator().manual_seed(1))
    at = 0
    while at < len(row):                            # walk the pairs: span, then itself again
        length = next(L for L in range(16, 129) if not m[at + L - 1] and
                      (at + L >= len(row) or m[at + L]))
        second = row[at + length:at + 2 * length]
        assert torch.equal(second, row[at:at + len(second)])
        assert m[at + length:at + 2 * length].all() and not m[at:at + length].any()
        at += 2 * length
    plain = window_batches(data, 512, 4, 0)(3)[2]
    assert plain.all()


def test_wired_previous_token_head_attends_one_back_in_transformers(tok_dir, tmp_path):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM
    from agent_runtime.model import save_model
    model = init_model(replace(TINY, previous_token_head=True, tie_embeddings=True),
                       load_tokenizer(tok_dir), seed=0)
    save_model(model, tmp_path / "m", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32,
                                              attn_implementation="eager")
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attn = hf(ids, output_attentions=True).attentions[0][:, 0]    # layer 0, head 0 [B, T, T]
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    back = attn.diagonal(offset=-1, dim1=1, dim2=2)                      # [B, T-1]
    assert back.min() > 0.99
    plain = init_model(TINY, load_tokenizer(tok_dir), seed=0)
    assert not torch.equal(plain.layers[0].self_attn.q_proj.weight,
                           model.layers[0].self_attn.q_proj.weight)


def test_a_wired_induction_head_copies_before_training_and_loads_in_transformers(tok_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from agent_runtime.model import save_model
    shape = ModelShape(hidden_size=160, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                       num_experts=8, top_k=2, expert_size=32, max_position=512, rope_theta=1e8,
                       tie_embeddings=True, previous_token_head=True, induction_head=True)
    model = init_model(shape, load_tokenizer(tok_dir), seed=0)
    span = torch.randint(3, 250, (4, 120), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([span, span], 1)                                   # a span, then again
    with torch.no_grad():
        nll = -model(ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    first, repeat = nll[:, :119].mean(), nll[:, 120:].mean()
    assert repeat < 2.0 and first > 4.0                                # copies, untrained
    unwired = init_model(replace(shape, induction_head=False), load_tokenizer(tok_dir), seed=0)
    with torch.no_grad():
        plain = -unwired(ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert plain[:, 120:].mean() > 4.0                                 # the wiring does it
    save_model(model, tmp_path / "m", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_two_token_induction_match_copies_where_one_token_is_ambiguous(tok_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    from agent_runtime.model import save_model
    shape = ModelShape(hidden_size=224, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                       num_experts=8, top_k=2, expert_size=32, max_position=512, rope_theta=1e8,
                       tie_embeddings=True, previous_token_head=True, induction_head=True)
    g = torch.Generator().manual_seed(2)
    alphabet = torch.randperm(240, generator=g)[:12] + 3
    span = alphabet[torch.randint(0, 12, (4, 120), generator=g)]     # each id ~10 times a span
    ids = torch.cat([span, span], 1)

    def repeat_nll(model):
        with torch.no_grad():
            nll = -model(ids).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        return nll[:, 121:].mean().item()      # from the second token of the repeat on

    one = init_model(shape, load_tokenizer(tok_dir), seed=0)
    two = init_model(replace(shape, induction_ngram=2), load_tokenizer(tok_dir), seed=0)
    assert repeat_nll(two) < 0.5 * repeat_nll(one)
    with pytest.raises(ValueError, match="no room"):
        init_model(replace(shape, hidden_size=160, induction_ngram=2), load_tokenizer(tok_dir))
    save_model(two, tmp_path / "m", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, two(ids).logits, rtol=1e-4, atol=1e-4)


def test_perplexity_windows_spread_over_the_whole_heldout_array(tok_dir):
    """Two windows are the first and the last of the array, not the first two (which on the
    default corpus are one table file)."""
    from learner.recipe.pretrain import perplexity
    model = init_model(TINY, load_tokenizer(tok_dir), seed=0).eval()
    seq = 32
    data = np.random.default_rng(0).integers(0, 256, size=10 * seq + 5).astype(np.uint16)
    tokens = torch.from_numpy(data.astype(np.int64))

    def window_loss(start: int) -> float:
        row = tokens[start:start + seq + 1][None]
        with torch.no_grad():
            logits = model(row[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits[0].float(), row[0, 1:]).item()

    first, second, last = window_loss(0), window_loss(seq), window_loss(len(data) - 1 - seq)
    assert abs(last - second) > 1e-3          # the placement is visible in the result
    got = perplexity(model, data, seq, 2, "cpu")
    assert got == pytest.approx(np.exp((first + last) / 2), rel=1e-5)
    assert perplexity(model, data, seq, 1, "cpu") == pytest.approx(np.exp(first), rel=1e-5)


def test_a_resumed_run_keeps_the_time_budget_it_had_left(tok_dir, tmp_path, monkeypatch):
    """`max_seconds` is the run's budget: a run killed and resumed stops where one that was
    never killed stops, not a whole budget after the resume. A fake clock moves 10 s a step."""
    from types import SimpleNamespace

    import learner.recipe.lm as lm
    clock = {"t": 1000.0}
    monkeypatch.setattr(lm, "time", SimpleNamespace(time=lambda: clock["t"]))
    data = np.asarray(load_tokenizer(tok_dir).encode(CODE), dtype=np.uint16)
    batch = window_batches(data, 32, 4, 0)

    def ticking(step):
        clock["t"] += 10.0
        return batch(step)
    cfg = LMConfig(steps=20, lr=5e-3, warmup=1, log_every=1, checkpoint_every=1,
                   max_seconds=55)
    straight = train_lm(_tiny_model(tok_dir), ticking, cfg, tmp_path / "a", log=lambda r: None)
    assert straight["steps"] == 6 and straight["seconds"] == 60.0   # over 55 s after step 6

    def killed_at_3(step):
        if step == 3:
            raise KeyboardInterrupt
        return ticking(step)
    with pytest.raises(KeyboardInterrupt):
        train_lm(_tiny_model(tok_dir), killed_at_3, cfg, tmp_path / "b", log=lambda r: None)
    clock["t"] += 3600.0                                   # an hour until it is run again
    seen = []
    again = train_lm(_tiny_model(tok_dir), ticking, cfg, tmp_path / "b", log=seen.append)
    assert {"resumed_at": 3, "seconds_spent": 30.0} in seen
    assert again["steps"] == 6 and again["seconds"] == 60.0


def test_a_stage_run_again_reports_its_time_over_both_runs(tmp_path, monkeypatch):
    """A stage that dies and is run again reports the seconds of both processes."""
    from types import SimpleNamespace

    import learner.recipe.stages as stages
    from learner.recipe import RecipeConfig, run_recipe
    clock = {"t": 1000.0}
    monkeypatch.setattr(stages, "time", SimpleNamespace(time=lambda: clock["t"]))
    calls = []

    def tokenizer(out, config, log):
        calls.append(1)
        clock["t"] += 30.0 if len(calls) == 1 else 20.0
        if len(calls) == 1:
            raise RuntimeError("killed")
        return {"vocab_size": 8}
    monkeypatch.setitem(stages.RUNNERS, "tokenizer", tokenizer)
    with pytest.raises(RuntimeError):
        run_recipe(tmp_path, RecipeConfig(), ("tokenizer",), log=lambda s: None)
    lines = []
    metrics = run_recipe(tmp_path, RecipeConfig(), ("tokenizer",), log=lines.append)["tokenizer"]
    assert metrics["seconds"] == 50.0 and metrics["seconds_before_resume"] == 30.0
    assert "[tokenizer] running (resumed after 30s)" in lines
    assert json.loads((tmp_path / "tokenizer" / "metrics.json").read_text())["seconds"] == 50.0


def test_a_stage_gets_what_the_whole_recipe_budget_leaves_it(tmp_path):
    """With `total_minutes`, the first training budget of a stage is cut to the whole budget
    less the stages done, the later budgets and the reserve; within it, nothing changes."""
    from learner.recipe import default_recipe
    from learner.recipe.stages import STAGES, fit_budget
    config = default_recipe()
    assert config.total_minutes == 150
    for stage, seconds in (("tokenizer", 94), ("corpus", 19), ("pretrain", 1816),
                           ("sft_data", 2300)):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "metrics.json").write_text(json.dumps({"seconds": seconds}))
    fitted, budget = fit_budget(config, tmp_path, "sft", STAGES)
    # 9,000 s - 4,229 done - 1,500 (second phase) - 600 (GRPO) - 600 reserve
    assert budget == 2071 and fitted.sft.train.max_seconds == 2071
    assert fitted.sft.code.train.max_seconds == 1500 and config.sft.train.max_seconds == 3000
    # without GRPO in the stages asked for, its budget is not kept back
    assert fit_budget(config, tmp_path, "sft", ("sft",))[1] == 2671
    # a fast machine: the stage keeps its own budget
    (tmp_path / "sft_data" / "metrics.json").write_text(json.dumps({"seconds": 1200}))
    assert fit_budget(config, tmp_path, "sft", STAGES) == (config, None)
    # never below a minute; stages without a budget and recipes without a total untouched
    (tmp_path / "sft_data" / "metrics.json").write_text(json.dumps({"seconds": 9000}))
    assert fit_budget(config, tmp_path, "sft", STAGES)[1] == 60
    assert fit_budget(config, tmp_path, "sft_data", STAGES) == (config, None)
    config.total_minutes = 0
    assert fit_budget(config, tmp_path, "sft", STAGES) == (config, None)


def test_pretrain_stage_writes_a_loadable_checkpoint_and_skips_when_done(tok_dir, tmp_path):
    from learner.recipe import RecipeConfig, run_recipe
    out = tmp_path / "recipe"
    (out / "tokenizer").mkdir(parents=True)
    for f in tok_dir.iterdir():
        (out / "tokenizer" / f.name).write_bytes(f.read_bytes())
    tok = load_tokenizer(tok_dir)
    ids = np.asarray(tok.encode(CODE), dtype=np.uint16)
    (out / "corpus").mkdir()
    np.savez_compressed(out / "corpus" / "corpus.npz", train=ids[:-2000], heldout=ids[-2000:])
    config = RecipeConfig(pretrain=PretrainConfig(
        shape=TINY, train=LMConfig(steps=3, warmup=1, log_every=1, checkpoint_every=3),
        seq_len=32, batch_size=2, eval_windows=4, device="cpu"))
    first = run_recipe(out, config, ("pretrain",), log=lambda s: None)["pretrain"]
    assert first["heldout_ppl"] > 1 and first["steps"] == 3
    assert set(first["copy_probe"]) == {"first", "repeat", "random_repeat"}
    assert all(np.isfinite(v) and v > 0 for v in first["copy_probe"].values())
    model = load_model(out / "pretrain" / "model")
    assert model.args.num_experts == 8 and model.args.top_k == 2 and model.dtype == torch.bfloat16
    assert load_tokenizer(out / "pretrain" / "model").vocab_size == tok.vocab_size
    lines = []
    run_recipe(out, config, ("pretrain",), log=lines.append)
    assert any("skipped" in line for line in lines)

    from agent_runtime.policies import load_policy
    from learner.recipe.ship import ship
    dest = tmp_path / "assets" / "default"
    dest.mkdir(parents=True)
    (dest / "stale.safetensors").write_bytes(b"old")
    assert ship(out, dest) == out / "pretrain" / "model"
    assert not (dest / "stale.safetensors").exists()
    record = json.loads((dest / "recipe.json").read_text())
    assert record["model"] == "pretrain/model"
    assert record["stages"]["pretrain"]["steps"] == 3 and "history" not in record["stages"]["pretrain"]
    policy = load_policy(str(dest))
    assert policy.model.args.num_experts == 8


def test_oracle_summary_has_the_requested_sections_and_next_edit():
    from agent_runtime.context import DEFAULT_SUMMARY_INSTRUCTION
    from learner.recipe.sft import summarize
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Fix `add` in calc.py.", "kind": "task"},
        {"role": "assistant", "content": "Reading.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file",
                                                          "arguments": {"path": "calc.py"}}}]},
        {"role": "tool", "content": "1\tdef add(a, b):\n2\t    return a - b", "tool_call_id": "c1"},
    ]
    plan = ['Fixing it.\n<tool_call>\n{"name": "edit_file", "arguments": {"path": "calc.py", '
            '"old": "return a - b", "new": "return a + b"}}\n</tool_call>']
    text = summarize(messages, plan)
    sections = [line for line in DEFAULT_SUMMARY_INSTRUCTION.splitlines() if line.startswith("## ")]
    assert [line for line in text.splitlines() if line.startswith("## ")] == sections
    assert "- read_file calc.py (ok)" in text and "return a - b" in text
    assert text.endswith("Fixing it.")


def code_files(folder: Path, n: int) -> list[tuple[str, Path]]:
    """`n` small source files cut from CODE, named as the corpus names them."""
    folder.mkdir()
    files = []
    for i in range(n):
        path = folder / f"mod{i}.py"
        path.write_text(CODE[i * 400:(i + 1) * 400] or "pass\n")
        files.append((f"stdlib/mod{i}.py", path))
    return files


def test_tokenizer_stage_trains_on_train_files_and_measures_heldout(tmp_path):
    files = code_files(tmp_path / "src", 200)
    metrics = ts.run(tmp_path / "tok", ts.TokenizerConfig(vocab_size=400, train_bytes=60_000), files)
    assert metrics["vocab_size"] == 400 and 1.5 < metrics["heldout_bytes_per_token"] < 6
    assert load_tokenizer(tmp_path / "tok").decode(load_tokenizer(tmp_path / "tok").encode(CODE[:500])) == CODE[:500]


def test_a_name_is_the_same_tokens_in_a_path_a_module_and_an_import(tmp_path):
    """The recipe's pre-tokenizer keeps punctuation off words: the file name the search
    prints (`pkg/name.py`) is the ids the import needs (`from .name`, `pkg.name`), where
    Qwen2's split makes `/name` and `.name` words of their own."""
    import regex
    forms = ("rota/availability.py", "from rota.availability import x",
             "from .availability import x")
    assert [w for f in forms for w in regex.findall(DEFAULT_PAT_STR, f) if "avail" in w] == \
        ["/availability", ".availability", "availability"]      # three different words
    config = ts.TokenizerConfig(vocab_size=600, train_bytes=40_000)
    ts.run(tmp_path / "tok", config, code_files(tmp_path / "src", 100))
    tok = load_tokenizer(tmp_path / "tok")
    name = tok.encode("availability")
    assert all(_contains(tok.encode(f), name) for f in forms), \
        [[tok.decode([i]) for i in tok.encode(f)] for f in forms]


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_tokenizer_counting_task_repositories_gives_their_identifiers_fewer_tokens(tmp_path):
    """The default recipe's tokenizer also counts the solved task repositories pre-training
    reads, so the names an episode copies are shorter token sequences."""
    from learner import tasks as sim
    files = code_files(tmp_path / "src", 100)
    sizes, toks = {}, {}
    for repos in (0, 12):
        config = ts.TokenizerConfig(vocab_size=600, train_bytes=40_000, task_repos=repos, task_seed=1)
        sizes[repos] = ts.run(tmp_path / f"tok{repos}", config, files)["train_bytes"]
        toks[repos] = load_tokenizer(tmp_path / f"tok{repos}")
    names = {q.plural for t in sim.generate("train", 12, seed=1)
             for d in sim.vocab.DOMAINS if d.key == t.meta.get("domain") for q in d.quantities}
    assert sizes[12] > sizes[0] and names
    cost = {r: sum(len(toks[r].encode(n)) for n in names) for r in toks}
    assert cost[12] < cost[0], cost


def test_solved_task_repositories_pass_their_hidden_tests(tmp_path):
    """The pre-training text is the repositories as solved: applying the oracle's edits in
    memory gives a workspace whose hidden tests pass (one instance of every family)."""
    import subprocess
    import sys

    from learner import tasks as sim
    from learner.recipe.task_corpus import solved_files
    for task in sim.generate("train", len(sim.FAMILIES), seed=3):
        root = tmp_path / task.id.replace("/", "_")
        for rel, text in solved_files(task).items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
                              + sorted(task.hidden_tests), cwd=root, capture_output=True,
                              text=True, env={**task.env, "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, (task.id, proc.stdout[-2000:])


def test_length_batches_show_every_sequence_once_per_epoch_within_budget():
    from learner.recipe.sft import length_batches
    rng = random.Random(0)
    seqs = [(np.arange(n, dtype=np.uint16), np.ones(n, dtype=np.uint8))
            for n in (rng.randint(5, 300) for _ in range(57))]
    batch = length_batches(seqs, batch_tokens=600, max_len=256, pad=0, seed=1)
    seen, step = Counter(), 0
    while sum(seen.values()) < len(seqs):
        ids, targets, mask = batch(step)
        assert ids.shape[0] * (ids.shape[1] + 1) <= 600 or ids.shape[0] == 1
        for row, m in zip(ids, mask):
            seen[int(m.sum()) + 1] += 1          # a row is known by its (cut) length
        step += 1
    assert seen == Counter(min(len(s), 256) for s, _ in seqs)


def test_packed_batches_train_the_tokens_padded_ones_do_with_the_same_loss_and_gradients(
        tok_dir, tmp_path):
    """SFT's sequences start alike (the system prompt): packed into a prefix tree, a step feeds
    those positions once, with the loss and gradients of the padded batch (a sequence sharing
    nothing, a duplicate whose tokens are trained twice, a cut at max_len), and train_lm
    takes either kind of batch."""
    from learner.recipe.sft import length_batches
    from learner.recipe.lm import Packed, token_logprobs
    torch.manual_seed(0)
    model = init_model(TINY, load_tokenizer(tok_dir), seed=0).float()
    rng = np.random.default_rng(0)
    head = rng.integers(0, 200, 40)
    seqs = []
    for n in (70, 90, 90, 200):
        ids = np.concatenate([head, rng.integers(0, 200, n)]).astype(np.uint16)
        mask = (rng.random(len(ids)) < 0.5).astype(np.uint8)
        mask[:40] = 0
        seqs.append((ids, mask))
    seqs.append(seqs[1])                                    # a duplicate: trained twice
    seqs.append((rng.integers(0, 200, 60).astype(np.uint16), np.ones(60, np.uint8)))
    padded = length_batches(seqs, batch_tokens=10**6, max_len=180, pad=0, seed=3)
    packed = length_batches(seqs, batch_tokens=10**6, max_len=180, pad=0, seed=3, pack=True)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ids, targets, mask = padded(0)
    p = packed(0)
    fed = [min(len(s), 180) - 1 for s, _ in seqs]
    assert isinstance(p, Packed) and p.ids.shape[1] == sum(fed) - 4 * 40 - (fed[4] - 40)
    assert len(p.targets) == int(mask.sum()) and p.rows is not None
    loss_a, ga = grads(-token_logprobs(model(ids, logits_at=mask).logits, targets[mask]).mean())
    logits = model(p.ids, positions=p.positions, paths=p.paths, logits_at=p.at).logits
    loss_b, gb = grads(-token_logprobs(logits.index_select(0, p.rows), p.targets).mean())
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    c = LMConfig(steps=2, lr=1e-3, warmup=1, checkpoint_every=10, log_every=1, precision="fp32")
    out = train_lm(model, packed, c, tmp_path / "state", log=lambda _: None)
    assert out["steps"] == 2 and np.isfinite(out["history"][-1]["loss"])


def test_head_on_the_mask_gives_the_logits_of_those_positions(tok_dir):
    model = init_model(TINY, load_tokenizer(tok_dir), seed=0)
    ids = torch.randint(0, 200, (2, 9))
    at = torch.rand(2, 9) < 0.4
    full = model(ids).logits
    assert torch.allclose(model(ids, logits_at=at).logits, full[at], atol=1e-6)


def renaming_setup(tok_dir, monkeypatch):
    """A real oracle episode (ids, mask), its tokenizer and harness text, and a pool of
    made-up words to rename into."""
    from learner.recipe import sft
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    tok = load_tokenizer(tok_dir)
    ids, mask = (np.asarray(a) for a in sft._collect_chunk(sft.Chunk(str(tok_dir), [2], [10**6]))["seqs"][0])
    rng = random.Random(0)
    pool = ["".join(rng.choice("bcdfgklmnprstvz") + rng.choice("aeiou") for _ in range(3))
            for _ in range(2000)]
    harness = tok.decode(ids[:list(ids).index(tok.special_tokens["<|im_end|>"])].tolist())
    return tok, ids, mask, pool, harness


def test_renaming_is_consistent_lossless_and_keeps_the_harness(tok_dir, monkeypatch):
    """A real oracle episode renamed and renamed back is the same tokens; the domain's words
    are gone from every part of it, the harness and Python's own names are untouched, and the
    trained tokens are the renamed completions."""
    import re
    from learner.recipe.augment import Renamer
    tok, ids, mask, pool, harness = renaming_setup(tok_dir, monkeypatch)
    renamer = Renamer(tok, harness, pool=pool)
    runs = renamer.runs(ids, mask)
    original = "".join(text for text, _ in runs)
    present = [w for w in renamer.words if re.search(rf"(?<![A-Za-z0-9]){w}(?![A-Za-z0-9])", original)]
    assert len(present) >= 3                                     # package, module, quantity
    mapping = renamer.mapping(random.Random(1), set(re.findall(r"[a-z]+", original.lower())))
    new_ids, new_mask = renamer.rename(runs, mapping)
    renamed = tok.decode(new_ids.tolist())
    for w in present:
        assert not re.search(rf"(?<![A-Za-z0-9]){w}(?![A-Za-z0-9])", renamed), w
        assert mapping[w] in renamed
    assert renamed.startswith(harness)                            # tools and prompt untouched
    assert renamed.count("<tool_call>") == original.count("<tool_call>")
    assert renamed.count("def ") == original.count("def ") and "return" in renamed
    trained = tok.decode(new_ids[new_mask.astype(bool)].tolist())
    assert trained == "".join(renamer.text(t, mapping) for t, m in runs if m)
    back = {v: k for k, v in mapping.items()}
    pattern = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(sorted(map(re.escape, back), key=len, reverse=True)) + r")(?![A-Za-z0-9])")
    restored = [(pattern.sub(lambda m: back[m.group(1)], t), m) for t, m in renamer.runs(new_ids, new_mask)]
    again_ids, again_mask = renamer.rename(restored, {})
    assert again_ids.tolist() == ids.tolist() and again_mask.tolist() == mask.astype(bool).tolist()


def test_merging_gives_two_of_an_episodes_words_one_name(tok_dir, monkeypatch):
    """With merge=1 every renamed episode has two of its domain words renamed alike (names
    that look alike: `orders.cli orders.csv`); with merge=0 they stay distinct."""
    import re
    from learner.recipe.augment import Renamer
    tok, ids, mask, pool, harness = renaming_setup(tok_dir, monkeypatch)
    original = tok.decode(ids.tolist())

    def names_after(merge: float) -> tuple[int, int]:
        renamer = Renamer(tok, harness, pool=pool, merge=merge)
        present = set(renamer._pattern.findall(original))
        new_ids, _ = renamer(ids, mask, random.Random(5))
        renamed = tok.decode(new_ids.tolist())
        assert not present & set(renamer._pattern.findall(renamed))
        new_words = {w for w in re.findall(r"[a-z]+", renamed) if w in pool}
        return len(present), len(new_words)

    n, distinct = names_after(0.0)
    assert n >= 3 and distinct >= n
    n, merged = names_after(1.0)
    assert merged < distinct


def test_instruction_noise_replaces_only_task_words_the_episode_never_repeats(tok_dir,
                                                                              monkeypatch):
    """InstructionNoise at rate 1 on a real oracle episode: the task's backticked spans and
    the words the episode repeats stay, every other plain word of the task is a pool word,
    and nothing outside the task changes (harness, tool results, trained tokens)."""
    import re
    from learner.recipe.augment import USER_TURN, InstructionNoise, Renamer
    tok, ids, mask, pool, harness = renaming_setup(tok_dir, monkeypatch)
    noise = InstructionNoise(Renamer(tok, harness, pool=pool), rate=1.0)
    original = tok.decode(ids.tolist())
    new_ids, new_mask = noise(ids, mask, random.Random(3))
    noised = tok.decode(new_ids.tolist())
    start = original.index(USER_TURN) + len(USER_TURN)
    end, new_end = original.index("<|im_end|>", start), noised.index("<|im_end|>", start)
    assert noised[:start] == original[:start] and noised[new_end:] == original[end:]
    task, new_task = original[start:end], noised[start:new_end]
    later = {w.lower() for w in re.findall(r"[A-Za-z]+", original[end:])}

    def plain_words(text: str) -> list[str]:                 # outside backticks, not in paths
        return [w for p in re.split(r"(`[^`]*`)", text) if not p.startswith("`")
                for w in re.findall(r"(?<![\w./`-])[A-Za-z]+(?![\w./`-])", p)]
    plain = plain_words(task)
    dropped = [w for w in plain if w.lower() not in later]
    assert dropped and new_task != task
    assert re.findall(r"`[^`]*`", new_task) == re.findall(r"`[^`]*`", task)
    new_plain = plain_words(new_task)
    assert len(new_plain) == len(plain)
    assert all(n == w if w.lower() in later else n in pool for w, n in zip(plain, new_plain))
    trained = lambda i, m: tok.decode(i[m.astype(bool)].tolist())
    assert trained(new_ids, new_mask) == trained(ids, mask)
    assert noise(ids, mask, random.Random(3))[0].tolist() == new_ids.tolist()   # seeded
    assert InstructionNoise(noise.renamer, rate=0.0)(ids, mask, random.Random(3))[0].tolist() \
        == ids.tolist()


def test_preamble_opens_the_task_and_changes_nothing_else(tok_dir, monkeypatch):
    """Preamble on a real oracle episode: one sentence (an opener or pool words) and a space
    before the first user turn's text, everything else (harness, the task itself, tool
    results, the trained tokens and their mask) as it was; seeded."""
    from learner.recipe.augment import OPENERS, USER_TURN, Preamble, Renamer
    tok, ids, mask, pool, harness = renaming_setup(tok_dir, monkeypatch)
    original = tok.decode(ids.tolist())
    start = original.index(USER_TURN) + len(USER_TURN)
    seen = set()
    for seed in range(12):
        preamble = Preamble(Renamer(tok, harness, pool=pool), words=0.5)
        new_ids, new_mask = preamble(ids, mask, random.Random(seed))
        opened = tok.decode(new_ids.tolist())
        assert opened[:start] == original[:start]
        head = opened[start:len(opened) - len(original) + start]
        assert opened.endswith(original[start:]) and head.endswith(" ") and head.strip()
        words = head.strip().rstrip(".:!").lower().split()
        kind = "opener" if head.strip() in OPENERS else "words"
        assert kind == "opener" or (2 <= len(words) <= 6 and all(w in pool for w in words))
        seen.add(kind)
        trained = lambda i, m: tok.decode(i[m.astype(bool)].tolist())
        assert trained(new_ids, new_mask) == trained(ids, mask)
        assert preamble(ids, mask, random.Random(seed))[0].tolist() == new_ids.tolist()
    assert seen == {"opener", "words"}


def test_sft_copy_windows_are_their_share_as_long_as_episodes_and_never_renamed(tok_dir):
    tok = load_tokenizer(tok_dir)
    start = tok.special_tokens["<|im_start|>"]
    episodes = [(np.array([start] + [5] * n, dtype=np.uint16), np.ones(n + 1, dtype=np.uint8))
                for n in (99, 199, 299)]
    copies = copy_sequences(tok, episodes * 4, share=0.2, seed=0)
    assert len(copies) == 3                                   # 3 of 15: a fifth
    assert all(len(ids) in (100, 200, 300) for ids, _ in copies)
    assert all(0 < m.sum() < len(m) and int(ids.max()) < tok.vocab_size for ids, m in copies)
    assert not set(tok.special_tokens.values()) & {int(t) for ids, _ in copies for t in ids}
    flip = _episodes_only(lambda ids, m, rng: (ids[::-1], m), start)
    rng = random.Random(0)
    assert flip(*copies[0], rng)[0] is copies[0][0]           # a copy window passes
    assert flip(*episodes[0], rng)[0][-1] == start            # an episode is transformed


def test_an_unknown_stage_is_an_error_not_a_skipped_stage(tmp_path):
    from learner.recipe import RECIPES, run_recipe
    with pytest.raises(ValueError, match="unknown recipe stage.*sfft.*sft_data"):
        run_recipe(tmp_path / "r", RECIPES["toy"](), ("tokenizer", "sfft"))
    assert not (tmp_path / "r").exists()


def test_the_grpo_stage_can_train_on_fresh_tasks_with_composed_wordings():
    from learner.config import parse_task_spec
    from learner.recipe.stages import GRPOStageConfig, grpo_tasks
    assert grpo_tasks(GRPOStageConfig()) == "sim"              # the SFT data's own instances
    spec = grpo_tasks(GRPOStageConfig(task_seed=7, phrasings=0.5))
    assert parse_task_spec(spec) == ("sim", {"seed": 7, "phrasings": 0.5})
    assert parse_task_spec(grpo_tasks(GRPOStageConfig(seed=2, phrasings=0.25))) == (
        "sim", {"seed": 2, "phrasings": 0.25})


def test_the_grpo_stage_can_draw_from_some_families_and_a_misspelt_one_is_named():
    from learner.config import parse_task_spec
    from learner.pipeline import task_family
    from learner.recipe.stages import GRPOStageConfig, grpo_tasks
    spec = grpo_tasks(GRPOStageConfig(families=("fix_bug", "rename_symbol")))
    assert parse_task_spec(spec) == ("sim", {"seed": 0, "phrasings": 0.0,
                                             "families": ["fix_bug", "rename_symbol"]})
    tasks, _ = task_family(spec)
    assert {t.family for t in tasks} == {"fix_bug", "rename_symbol"}
    for bad in ("sim:families=fixbug", "sim:families=", "sim:families=fix_bug+nope"):
        with pytest.raises(ValueError, match="give one or more of fix_"):
            parse_task_spec(bad)


def test_the_grpo_stage_can_train_on_a_few_fixed_tasks():
    from learner.config import parse_task_spec
    from learner.pipeline import task_family
    from learner.recipe.stages import GRPOStageConfig, grpo_tasks
    spec = grpo_tasks(GRPOStageConfig(task_count=6, families=("fix_bug",)))
    assert parse_task_spec(spec)[1]["count"] == 6
    tasks, _ = task_family(spec)
    assert len(tasks) == 6 and {t.family for t in tasks} == {"fix_bug"}
    assert [t.id for t in tasks] == [t.id for t in task_family(spec)[0]]      # the same six
    for bad in ("sim:count=0", "sim:count=two"):
        with pytest.raises(ValueError, match="count=N"):
            parse_task_spec(bad)


def test_a_grep_slip_searches_for_a_name_the_code_lacks_then_for_the_plans():
    from agent_runtime.toolcalls import parse_tool_calls
    from learner.recipe.sft import with_slip
    from learner.tasks.oracle import script
    renames = [t for t in sim.generate("train", 60) if t.family == "rename_symbol"]
    kinds = set()
    for task in renames:
        turns = script(task)
        out, slips = with_slip(turns, random.Random(task.id), task.files, task.instruction)
        if not slips:
            continue
        i = out.index(next(iter(slips)))
        slip, = parse_tool_calls(out[i]).calls
        if slip.name != "grep":
            continue
        plan, = [c for c in parse_tool_calls(turns[i]).calls]
        wrong, right = slip.arguments["pattern"], plan.arguments["pattern"]
        assert wrong != right and not any(wrong in t for t in task.files.values())
        kinds.add("new name" if wrong == task.meta["new"] else "typo")
        assert f"`{right}`" in out[i + 1].split("<tool_call>")[0]    # the recovery names it
        assert [c.arguments for c in parse_tool_calls(out[i + 1]).calls] == [plan.arguments]
        assert out[:i] + out[i + 2:] == turns[:i] + turns[i + 1:]
    assert kinds == {"new name", "typo"}
    # without the files, no grep is ever chosen (the default data is as it was)
    for task in renames:
        out, slips = with_slip(script(task), random.Random(task.id))
        assert all(parse_tool_calls(s).calls[0].name != "grep" for s in slips)


def test_the_escape_split_makes_json_escaped_code_the_files_words():
    import json
    import regex
    code = 'def f(widths):\n    for w in widths:\n        out.append(w)\n    return out\n'
    words = regex.findall(ts.ESCAPE_PAT_STR, code)
    escaped = regex.findall(ts.ESCAPE_PAT_STR, json.dumps(code)[1:-1])
    assert words == ["\n" if w == "\\n" else w for w in escaped]     # newline <-> `\n`
    assert "):" in escaped and "\\n" in escaped                 # no `):\` or `\ndef` words
    assert regex.findall(ts.CODE_PAT_STR, "f(x):\\ndef") != regex.findall(ts.ESCAPE_PAT_STR,
                                                                          "f(x):\\ndef")


def test_sft_data_with_mentions_shows_the_oracle_where_the_names_are(tok_dir, monkeypatch):
    from agent_runtime.mentions import HEADER
    from learner.recipe import sft
    monkeypatch.setenv("APPRENTICE_SANDBOX", "off")
    number = next(i for i, t in enumerate(sim.generate("train", 24)) if t.family == "fix_bug")
    tok = load_tokenizer(tok_dir)
    texts = {}
    for mentions in (False, True):
        out = sft._collect_chunk(sft.Chunk(str(tok_dir), [number], [10**6], mentions=mentions))
        assert out["passed"] == 1
        texts[mentions] = tok.decode(list(out["seqs"][0][0]))
    assert HEADER in texts[True] and HEADER not in texts[False]


def test_the_grpo_stage_passes_its_settings_to_the_learner(tmp_path):
    from learner.online import TRAINABLE
    from learner.recipe.stages import GRPOStageConfig, grpo_run_config
    g = GRPOStageConfig(lr=1e-4, trainable=TRAINABLE, task_seed=1, phrasings=0.6,
                        partial_credit=0.5, oracle_start=0.5, kl_coef=0.05,
                        balance=True, stop_after_failed_checks=1, check_references=False)
    run = grpo_run_config(g, tmp_path / "sft" / "model", "cpu")
    assert run.trainer.loss.kl_coef == 0.05 and run.trainer.loss.balance
    assert run.model == str(tmp_path / "sft" / "model") and run.tasks == "sim:seed=1,phrasings=0.6"
    assert run.trainer.trainable == TRAINABLE and run.trainer.optim.lr == 1e-4
    assert run.trainer.router_replay and run.pipeline.torch_threads == 1
    assert run.rollout.partial_credit == 0.5 and run.rollout.oracle_start == 0.5
    assert run.rollout.stop_after_failed_checks == 1 and not run.rollout.check_references
    default = grpo_run_config(GRPOStageConfig(), tmp_path, "cpu")
    assert default.trainer.trainable == () and default.rollout.partial_credit == 0.0
    assert default.rollout.oracle_start == 0.0 and default.trainer.loss.kl_coef == 0.0
    assert not default.trainer.loss.balance and default.rollout.stop_after_failed_checks == 0
    assert default.rollout.check_references


def test_set_overrides_one_field_of_the_recipe_by_its_type():
    from learner.recipe import default_recipe
    from learner.recipe.stages import override
    c = default_recipe()
    assert c.grpo.lr != 3e-5 and c.grpo.max_skipped != 6
    for setting in ("grpo.lr=3e-5", "grpo.max_skipped=6", "sft.train.max_seconds=3300",
                    "grpo.curriculum=false", "grpo.trainable=\\.mlp\\.experts\\.,lm_head",
                    "grpo.task_seed=none"):
        override(c, setting)
    assert c.grpo.lr == 3e-5 and c.grpo.max_skipped == 6 and c.grpo.curriculum is False
    assert c.sft.train.max_seconds == 3300.0 and c.grpo.task_seed is None
    assert c.grpo.trainable == ("\\.mlp\\.experts\\.", "lm_head")
    for bad, says in (("grpo.lrr=1", "no field 'lrr'"), ("gpro.lr=1", "not a section"),
                      ("grpo.steps=many", "not a valid int"), ("grpo.lr", "SECTION.FIELD=VALUE"),
                      ("grpo.curriculum=maybe", "not a valid bool")):
        with pytest.raises(ValueError, match=says):
            override(c, bad)


def test_learn_recipe_rejects_a_bad_set_before_running_anything(tmp_path):
    from click.testing import CliRunner
    from learner.cli import learn
    out = CliRunner().invoke(learn, ["recipe", "toy", "--out", str(tmp_path / "r"),
                                     "--set", "grpo.nope=1"])
    assert out.exit_code != 0 and "no field 'nope'" in out.output
    assert not (tmp_path / "r").exists()


def test_the_grpo_stage_averages_the_last_share_of_its_versions():
    from learner.recipe.stages import averaged_versions
    assert averaged_versions(100, 0.5) == list(range(51, 101))   # SWA over the second half
    assert averaged_versions(100, 1.0) == list(range(1, 101))    # from the starting weights
    assert averaged_versions(100, 0.0) == [100]                  # off: the final weights
    assert averaged_versions(1, 0.5) == [1] and averaged_versions(None, 0.5) == []


def test_the_grpo_stage_model_is_the_mean_of_the_published_versions(tok_dir, tmp_path):
    from learner.recipe.stages import load_mean
    from learner.versions import VersionStore
    model = init_model(replace(TINY, tie_embeddings=True), load_tokenizer(tok_dir), 0)
    store = VersionStore(tmp_path / "versions")
    states = []
    for seed in range(3):                 # three versions, as the trainer publishes them
        g = torch.Generator().manual_seed(seed)
        state = {k: (v.float() + 0.01 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
                 for k, v in model.state_dict().items()}
        state["lm_head.weight"] = state["embed_tokens.weight"]    # one tensor, as published
        states.append(state)
        store.publish(state)
    load_mean(model, store, [1, 2, 3])
    for k, v in model.state_dict().items():
        mean = sum(s[k].float() for s in states) / 3
        assert torch.allclose(v.float(), mean, rtol=0, atol=1e-6), k
    assert model.lm_head.weight is model.embed_tokens.weight       # still tied
    with pytest.raises(ValueError, match="not this model's weights"):
        load_mean(init_model(replace(TINY, num_experts=4), load_tokenizer(tok_dir), 0), store,
                  [1, 2])


def test_averaging_checkpoints_writes_the_mean_of_their_weights(tok_dir, tmp_path):
    from click.testing import CliRunner

    from learner.cli import learn
    from learner.merge import average_checkpoints
    from learner.recipe.pretrain import copy_tokenizer
    models = []
    for seed in range(2):
        models.append(init_model(replace(TINY, tie_embeddings=True), load_tokenizer(tok_dir), seed))
        save_model(models[-1], tmp_path / f"m{seed}", dtype="bfloat16")
        copy_tokenizer(tok_dir, tmp_path / f"m{seed}")
    out = average_checkpoints([tmp_path / "m0", tmp_path / "m1"], tmp_path / "mean", [1, 3])
    saved = load_model(out).state_dict()
    for k, v in saved.items():
        parts = [load_model(tmp_path / f"m{i}").state_dict()[k].float() for i in range(2)]
        assert torch.equal(v, ((parts[0] + 3 * parts[1]) / 4).to(v.dtype)), k
    assert load_tokenizer(out).encode("def f(x):") == load_tokenizer(tok_dir).encode("def f(x):")
    other = init_model(replace(TINY, num_experts=4), load_tokenizer(tok_dir), 0)
    save_model(other, tmp_path / "other")
    result = CliRunner().invoke(learn, ["average", str(tmp_path / "bad"), str(tmp_path / "m0"),
                                        str(tmp_path / "other")])
    assert result.exit_code != 0 and "not the architecture of" in result.output
