"""Stage 2 of the recipe: a fresh MoE pre-trained on the code corpus by next-token prediction.

`encode_corpus` turns the corpus files into two flat token arrays (train and held-out, split by
file as in the tokenizer stage), each file followed by `<|endoftext|>`, saved as one compressed
`corpus.npz` (uint16 when the vocabulary fits). `init_model` builds the MoE from a `ModelShape`
(a qwen3_moe config that `transformers` loads unchanged). `run` trains on random windows of the
train array (a function of the step, so resuming is exact), reports held-out perplexity on fixed
windows, and writes the HF checkpoint with the tokenizer next to it.

It does not train the tokenizer (`tokenizer_stage`) or know about chat formats (`sft`).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from agent_runtime.model import load_tokenizer, save_model
from agent_runtime.model.config import args_from_hf
from agent_runtime.model.model import MoEModel
from learner.recipe.lm import LMConfig, train_lm
from learner.recipe.tokenizer_stage import is_heldout, read_texts

TOKENIZER_FILES = ("tokenizer.tiktoken", "tiktoken_config.json", "tokenizer_config.json")
MAX_SHARD_BYTES = 15 * 2**20        # shards small enough to travel one file at a time


@dataclass
class ModelShape:
    hidden_size: int = 384          # residual width
    num_layers: int = 6             # decoder blocks, every one MoE
    num_heads: int = 6              # query heads of head_dim each
    num_kv_heads: int = 2           # key/value heads (grouped-query attention)
    head_dim: int = 64
    num_experts: int = 8            # routed experts per layer
    top_k: int = 2                  # experts per token
    expert_size: int = 256          # intermediate width of one expert
    max_position: int = 4096        # context window
    rope_theta: float = 10000.0
    tie_embeddings: bool = False    # untied: the output head gets its own matrix
    previous_token_head: bool = False  # start with a wired previous-token head in layer 0
                                    # (`wire_previous_token_head`)
    induction_head: bool = False    # ... and the whole copying circuit (`wire_induction_head`;
                                    # needs previous_token_head and tied embeddings)
    induction_ngram: int = 1        # tokens the circuit matches on (1 or 2)

    def hf_config(self, vocab_size: int, eos_token_id: int | None, pad_token_id: int | None) -> dict:
        return {
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.expert_size, "intermediate_size": 4 * self.expert_size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": self.max_position, "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta, "hidden_act": "silu", "attention_bias": False,
            "attention_dropout": 0.0, "router_aux_loss_coef": 0.001, "output_router_logits": False,
            "use_sliding_window": False, "tie_word_embeddings": self.tie_embeddings,
            "apprentice_harness": "compact",   # trained with COMPACT_CHAT_TEMPLATE's tool listing
            "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        }


@dataclass
class PretrainConfig:
    shape: ModelShape = field(default_factory=ModelShape)   # the model to build
    train: LMConfig = field(default_factory=lambda: LMConfig(
        steps=20000, lr=2e-3, warmup=100, max_seconds=600, fit_to_time=True,
        checkpoint_every=500, log_every=50))                # the optimization (10 min)
    corpus_bytes: int = 48_000_000  # source bytes tokenized for training (held-out on top)
    task_repos: int = 0             # solved simulated training repositories added to the train
                                    # text (`task_corpus`): the code the tasks are made of
    heldout_bytes: int = 1_000_000  # held-out source bytes (perplexity)
    heldout_percent: int = 2        # must match the tokenizer stage's split
    seq_len: int = 2048             # tokens per training window
    repeat_share: float = 0.0       # share of windows in which a span of the window's own text
                                    # comes back later (`with_repeats`): copying from context
    copy_share: float = 0.0         # share of windows made of random spans each written twice,
                                    # trained on the second copy only (`copy_window`)
    batch_size: int = 32            # windows per step
    eval_windows: int = 64          # held-out windows scored for perplexity
    eval_every: int = 0             # steps between perplexity evaluations (0: at the end)
    device: str = "auto"            # "auto": cuda when available, else cpu
    seed: int = 0                   # initialization and data order


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def encode_corpus(tok, files: list[tuple[str, Path]], config: PretrainConfig, path: Path) -> dict:
    """Tokenize the train and held-out files into `path` (corpus.npz); return counts."""
    eot = tok.special_tokens["<|endoftext|>"]
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.int32
    out = {}
    for split, budget in (("train", config.corpus_bytes), ("heldout", config.heldout_bytes)):
        chosen = [(n, p) for n, p in files if is_heldout(n, config.heldout_percent) == (split == "heldout")]
        ids: list[int] = []
        texts = [t for _, t in read_texts(chosen, budget)]
        if split == "train" and config.task_repos:
            from learner.recipe.task_corpus import repo_texts
            texts += [t for _, t in repo_texts(config.task_repos, seed=config.seed)]
        for text in texts:
            ids.extend(tok.encode(text, special=False))
            ids.append(eot)
        out[split] = np.asarray(ids, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **out)
    return {f"{k}_tokens": int(v.size) for k, v in out.items()}


def init_model(shape: ModelShape, tok, seed: int = 0) -> MoEModel:
    """A freshly initialized MoE: N(0, 0.02), output projections scaled by 1/sqrt(2 * layers)."""
    cfg = shape.hf_config(_round_vocab(tok.vocab_size), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    model = MoEModel(args_from_hf(cfg), cfg)
    std_out = 0.02 / math.sqrt(2 * shape.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("o_proj.weight") or name.endswith("experts.down"):
                p.normal_(0.0, std_out)
            else:
                p.normal_(0.0, 0.02)
        if shape.previous_token_head:
            wire_previous_token_head(model)
        if shape.induction_head:
            wire_induction_head(model, ngram=shape.induction_ngram)
    return model


@torch.no_grad()
def wire_previous_token_head(model: MoEModel, layer: int = 0, head: int = 0,
                             margin: float = 8.0, bias: float = 0.1, back: int = 1) -> None:
    """Make query head `head` of `layer` attend to the previous position (`back` positions
    back), whatever the tokens.

    Copying from the context (an induction head: find the earlier occurrence of the current
    token, predict the token that followed it) needs a head that moves each token's identity
    one position on, and a second one that matches on it; gradient descent finds the pair only
    after a long plateau, longer than a CPU pre-training lasts (measured: no copying after
    350 steps on repeated random sequences of a 1,000-token vocabulary, and after 300 steps
    of code windows). With the first head given, the second is learned within a few hundred
    steps. The head is built from parts the architecture has, so `transformers` loads it
    unchanged: embedding column 0 gets a constant `bias` (after RMSNorm, a constant input
    direction; with a tied head it adds the same logit to every token), the head's query and
    its key/value head's key read only that column, on the rotary pairs that turn by at least
    0.1 rad a position, with the query's phase one position behind the key's; per-head
    q/k-norm then makes both vectors constant, so the score depends on the distance alone and
    peaks at `back`. The q/k-norm weights of those dimensions (shared by the layer's heads) are set
    so that position leads its neighbours by `margin` nats. Value and output stay
    random: which part of the token it carries is left to training."""
    a = model.args
    if a.qk_norm != "head":
        raise ValueError(f"a wired previous-token head needs per-head q/k norms (qwen3_moe), not {a.qk_norm!r}")
    att = model.layers[layer].self_attn
    D, half = a.head_dim, a.head_dim // 2
    theta = model.inv_freq.double()
    pairs = [f for f in range(half) if theta[f] >= 0.1]
    spread = float(sum(1 - math.cos(theta[f]) for f in pairs))     # score lost one step away
    # a pair of unit-RMS q and k (|z|^2 = D/n each) scores (D/n) * w^2 * scale at its peak
    w = math.sqrt(margin / spread * len(pairs) / (D * a.scale))
    kv = head // (a.num_heads // a.num_kv_heads)
    model.embed_tokens.weight[:, 0] = bias
    q = att.q_proj.weight[head * D:(head + 1) * D]
    k = att.k_proj.weight[kv * D:(kv + 1) * D]
    q.zero_()
    k.zero_()
    for f in pairs:                 # rotary pair (f, f + D/2); query phase -theta_f
        q[f, 0], q[f + half, 0] = math.cos(back * theta[f]), -math.sin(back * theta[f])
        k[f, 0] = 1.0
        for norm in (att.q_norm, att.k_norm):
            norm.weight[f] = norm.weight[f + half] = w


@torch.no_grad()
def wire_induction_head(model: MoEModel, logit_gain: float = 4.0, margin: float = 8.0,
                        ngram: int = 1) -> None:
    """Give the model, at initialization, a working induction circuit: at every position, look
    up the earlier positions that followed the current token and predict the token found there.

    Measured on the default shape: with only the previous-token head wired, 380 steps of
    pre-training with 40 % copy windows ended with no copying at all (the repeat of a random
    span scored 9.0 nats, as its first copy); gradient descent does not find the matching half
    within a CPU's budget. Wired whole, the circuit copies before the first step, and training
    keeps and uses it. The parts, all ordinary weights (`transformers` loads them unchanged):

    - residual layout: the last `head_dim` dimensions of the residual stream are a channel,
      zero in every token embedding; dimensions 1..head_dim hold the "content" the circuit
      reads (dimension 0 is the previous-token head's constant);
    - layer 0, head 0 (the previous-token head, `wire_previous_token_head`): its value reads
      the content, its output writes it into the channel, so each position carries its
      predecessor's content;
    - layer 1, head 0: its query reads the position's own content, its key reads the channel,
      both on the rotary pairs that turn less than 1e-4 rad a position (so the match does not
      depend on distance; a large `rope_theta` keeps enough of them), with q/k-norm weights
      for a `margin`-nat lead of an exact match over a chance one; its value reads the content
      of the position it finds and its output writes that content back, so the final norm and
      the tied output head turn it into the logit of that token;
    - the other heads' and the experts' output projections start at zero (the circuit is the
      whole initial function), and the final norm is scaled by `logit_gain`: tied logits are
      otherwise too small for a confident copy;
    - with `ngram=2` the match is on two tokens: layer 0's head 1 (which shares head 0's key
      and value) attends two positions back and writes that content into a second channel
      (the `head_dim` dimensions before the first), and half of the matching dimensions
      compare the previous token (the first channel at the query) with the token before the
      candidate (the second channel at the key). A one-token match is ambiguous wherever
      the current token is common (`, ` in a list of numbers, `/` in a path): measured
      untrained on the default shape, the repeat of spans drawn from 20 ids scores 6.29 nats
      with one token and 1.59 with two, the repeat of held-out code 2.31 and 1.38.
    """
    a = model.args
    if not a.tie_embeddings or a.qk_norm != "head" or a.num_layers < 2:
        raise ValueError("an induction head needs tied embeddings, per-head q/k norms and 2 layers")
    H, D = a.hidden_size, a.head_dim
    if ngram not in (1, 2):
        raise ValueError(f"ngram must be 1 or 2, got {ngram}")
    if ngram == 2 and a.num_heads // a.num_kv_heads < 2:
        raise ValueError("a two-token match needs two query heads on layer 0's first key/value head")
    if H < (ngram + 1) * D + 1:
        raise ValueError(f"hidden size {H} leaves no room for {ngram} {D}-wide channels beside the content")
    content, channel = range(1, D + 1), range(H - D, H)
    before = range(H - 2 * D, H - D)                       # ngram 2: the token two back
    model.embed_tokens.weight[:, H - ngram * D:] = 0
    prev = model.layers[0].self_attn
    prev.v_proj.weight[:D] = 0
    prev.o_proj.weight[:, :ngram * D] = 0
    for i in range(D):
        prev.v_proj.weight[i, content[i]] = 1.0
        prev.o_proj.weight[channel[i], i] = 0.02            # the embeddings' own scale
    if ngram == 2:
        wire_previous_token_head(model, head=1, margin=margin, back=2)
        for i in range(D):
            prev.o_proj.weight[before[i], D + i] = 0.02
    ind = model.layers[1].self_attn
    slow = [f for f in range(D // 2) if model.inv_freq[f] < 1e-4]
    dims = slow + [f + D // 2 for f in slow]
    if len(dims) < 16:
        raise ValueError(f"rope_theta {a.rope_theta}: only {len(dims)} slow rotary dimensions")
    q, k = ind.q_proj.weight[:D], ind.k_proj.weight[:D]
    q.zero_()
    k.zero_()
    for j, d in enumerate(dims):
        if ngram == 1 or j < len(dims) // 2:
            q[d, content[j]] = 1.0                          # this token ~ the one before
            k[d, channel[j]] = 1.0
        else:
            q[d, channel[j]] = 1.0                          # the token before ~ two before
            k[d, before[j]] = 1.0
    # unit-RMS q and k over D with n = len(dims) live entries: an exact match scores
    # D * w^2 * scale, a chance match about half that at most
    w = math.sqrt(margin / (0.5 * D * a.scale))
    for norm in (ind.q_norm, ind.k_norm):
        norm.weight[dims] = w
    ind.v_proj.weight[:D] = 0
    ind.o_proj.weight[:, :D] = 0
    for i in range(D):
        ind.v_proj.weight[i, content[i]] = 1.0
        ind.o_proj.weight[content[i], i] = 1.0
    for n, block in enumerate(model.layers):
        block.self_attn.o_proj.weight[:, (ngram if n == 0 else 1) * D if n < 2 else 0:] = 0
        block.mlp.experts.down.zero_()
    model.norm.weight.mul_(logit_gain)


def _round_vocab(n: int) -> int:
    return -(-n // 64) * 64


def window_batches(data: np.ndarray, seq_len: int, batch_size: int, seed: int,
                   repeat_share: float = 0.0, copy_share: float = 0.0
                   ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """batch(step): `batch_size` random windows of `seq_len + 1` tokens, fixed by (seed, step);
    a `repeat_share` of them pass through `with_repeats`, a `copy_share` of them are replaced
    by `copy_window` rows (loss on their second copies only)."""
    tokens = torch.from_numpy(data.astype(np.int64))
    vocab = torch.from_numpy(np.unique(data).astype(np.int64)) if copy_share else None
    high = len(tokens) - seq_len - 1
    if high <= 0:
        raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one window ({seq_len + 1})")

    def batch(step: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, high, (batch_size,), generator=g)
        rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
        repeat = torch.rand(batch_size, generator=g) < repeat_share
        for i in repeat.nonzero()[:, 0].tolist():
            rows[i] = with_repeats(rows[i], g)
        mask = torch.ones(batch_size, seq_len + 1, dtype=torch.bool)
        copy = torch.rand(batch_size, generator=g) < copy_share
        for i in copy.nonzero()[:, 0].tolist():
            rows[i], mask[i] = copy_window(vocab, seq_len + 1, g)
        return rows[:, :-1], rows[:, 1:], mask[:, 1:]
    return batch


def copy_window(ids: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` tokens of random spans (16 to 128 tokens, each drawn uniformly from `ids`) each
    followed by itself, and the mask of the second copies.

    The first copy of a span is unpredictable and the second is predictable only by copying,
    so these rows are the plainest signal for the matching half of an induction head, the
    mechanism that lets a model repeat a path or a name it has just read. Uniform draws make
    every match unambiguous (spans drawn from running text repeat its common tokens, whose
    earlier occurrences point everywhere). The first copies are not trained on."""
    row = torch.empty(n, dtype=torch.long)
    mask = torch.zeros(n, dtype=torch.bool)
    at = 0
    while at < n:
        length = min(int(torch.randint(16, 129, (1,), generator=g)), max(1, n // 2))
        span = ids[torch.randint(0, len(ids), (length,), generator=g)]
        pair = torch.cat([span, span])[:n - at]
        row[at:at + len(pair)] = pair
        mask[at + length:at + len(pair)] = True
        at += len(pair)
    return row, mask


def with_repeats(row: torch.Tensor, g: torch.Generator, spans: int = 3) -> torch.Tensor:
    """`row` with up to `spans` of its own spans (16 to 128 tokens) written again further on.

    Code repeats names a few times but rarely whole lines, so a model pre-trained on a small
    corpus learns to recall its training text rather than to copy from its context, which is
    what every task needs (the file it just read, the name in the request). A span that comes
    back is predictable only by copying it."""
    row = row.clone()
    n = len(row)
    for _ in range(spans):
        length = int(torch.randint(16, 129, (1,), generator=g))
        if 2 * length + 2 > n:
            break
        src = int(torch.randint(0, n - 2 * length, (1,), generator=g))
        dst = int(torch.randint(src + length, n - length + 1, (1,), generator=g))
        row[dst:dst + length] = row[src:src + length].clone()
    return row


@torch.no_grad()
def copy_probe(model: MoEModel, data: np.ndarray, spans: int = 8, length: int = 100,
               seed: int = 0) -> dict:
    """Mean next-token loss (nats) on `spans` held-out spans of `length` tokens ("first") and
    on the same spans written a second time right after ("repeat"), and on the second copy of
    spans of tokens drawn uniformly from the held-out ids ("random_repeat"; the first copy of
    those scores about log(ids)): a model that copies from its context scores a repeat far
    below its first copy (an untrained or recall-only one scores them alike)."""
    model.eval()
    tokens = torch.from_numpy(data.astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - length, (spans,), generator=g).tolist()
    x = torch.stack([tokens[s:s + length] for s in starts])
    ids = torch.from_numpy(np.unique(data).astype(np.int64))
    r = ids[torch.randint(0, len(ids), (spans, length), generator=g)]
    batch = torch.cat([torch.cat([x, x], 1), torch.cat([r, r], 1)])
    batch = batch.to(model.embed_tokens.weight.device)
    logp = model(batch).logits.float().log_softmax(-1)
    nll = -logp[:, :-1].gather(-1, batch[:, 1:, None])[..., 0]
    return {"first": float(nll[:spans, :length - 1].mean()),
            "repeat": float(nll[:spans, length:].mean()),
            "random_repeat": float(nll[spans:, length:].mean())}


@torch.no_grad()
def perplexity(model: MoEModel, data: np.ndarray, seq_len: int, windows: int, device: str) -> float:
    """exp(mean next-token loss) over up to `windows` held-out windows spread evenly over the
    whole of `data`. Consecutive windows from its start measured the first file or two (on the
    default corpus a table of character frequencies, whose perplexity moved opposite to the
    rest's: README, "Held-out perplexity")."""
    model.eval()
    tokens = torch.from_numpy(data.astype(np.int64))
    n = min(windows, (len(tokens) - 1) // seq_len)
    if n == 0:
        return float("nan")
    starts = np.linspace(0, len(tokens) - 1 - seq_len, n).astype(np.int64)
    total, count = 0.0, 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") \
        else torch.autocast("cpu", enabled=False)
    for i in range(0, n, 8):
        rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts[i:i + 8]]).to(device)
        with autocast:
            logits = model(rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 rows[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += rows[:, 1:].numel()
    return math.exp(total / count)


def copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def run(tokenizer_dir: Path, corpus: Path, out: Path, config: PretrainConfig,
        log: Callable[[dict], None] = print) -> dict:
    """Pre-train from scratch on `corpus` (see `encode_corpus`); write the checkpoint to `out/model`."""
    tok = load_tokenizer(tokenizer_dir)
    device = pick_device(config.device)
    data = np.load(corpus)
    train, heldout = data["train"], data["heldout"]
    model = init_model(config.shape, tok, config.seed)
    batch = window_batches(train, config.seq_len, config.batch_size, config.seed,
                           config.repeat_share, config.copy_share)

    def evaluate() -> dict:
        return {"heldout_ppl": perplexity(model, heldout, config.seq_len, config.eval_windows, device),
                "copy_probe": copy_probe(model, heldout)}

    result = train_lm(model, batch, config.train, out / "state", device, evaluate,
                      config.eval_every, log)
    final = evaluate()
    model.to("cpu")
    save_model(model, out / "model", dtype="bfloat16", max_shard_bytes=MAX_SHARD_BYTES)
    copy_tokenizer(tokenizer_dir, out / "model")
    params = sum(p.numel() for p in model.parameters())
    return {**final, "heldout_tokens": int(heldout.size), "train_tokens": int(train.size),
            "params": params, "device": device, "shape": asdict(config.shape),
            "tokens_seen": result["steps"] * config.batch_size * config.seq_len,
            "seconds": result["seconds"], "steps": result["steps"], "history": result["history"]}
