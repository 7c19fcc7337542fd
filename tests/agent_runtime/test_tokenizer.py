"""The tiktoken-backed tokenizer gives HF `tokenizers`' ids, on vocabularies trained here offline."""

from __future__ import annotations

import glob
import json
import os
import random
import sysconfig
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from agent_runtime.model.tokenizer import (  # noqa: E402
    Tokenizer, byte_level_tokenizer, load_tokenizer,
)

QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
              r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|im_start|>", "<|im_end|>"]
NON_SPECIAL = ["<tool_call>", "</tool_call>"]
STDLIB = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))


def stdlib_text(files: list[str], limit: int) -> list[str]:
    docs, total = [], 0
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                doc = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        docs.append(doc)
        total += len(doc)
        if total >= limit:
            break
    return docs


UNICODE_POOLS = [
    "日本語の文章と中文句子，还有한국어 문장。「引用」",
    "😀🎉🚀👍🏽👨‍👩‍👧‍👦🏳️‍🌈🇯🇵🇫🇷✨❤️‍🔥",
    "e\u0301 a\u0308 n\u0303 o\u0302\u0323 Z\u0351\u0360\u036b\u0343 é ñ ü Å Å",      # combining
    "Привет мир Ελληνικά עברית العربية हिन्दी ไทย ქართული",
    "∑∫√∞≠≤≥ ½ ² ³ ① ﬁ ＡＢＣ１２３ \u00a0\u2003\u3000\u200b\ufeff",
    "I'll we've they're it's He'S THEY'RE you'D 'tis",
    "\t\t  \n\r\n  \t\n\n\n    \r\r\n\x0b\x0c\x85 ",
    "<|im_start|>user\n<|im_end|><tool_call>{}</tool_call><|im_start<|im_end|>> <|endoftext|>",
    "0123456789 3.14159 1,000,000 0x1F 1e-9 ١٢٣ ४२ x²+½ Ⅻ  12  \n 7",
]
WORDS = ("the of and to in is that for it as with was on be by this are from or have an "
         "they which one you were all we her she there would their will when who him been "
         "has more if no out so said what up its about than into them can only other time "
         "new some could these two may first then do any like my now over such our man me "
         "even most made after also did many before must through back years where much your "
         "way well down should because each just those people how too little state good very "
         "make world still own see men work long get here between both life being under never"
         ).split()


def generated_text(rng: random.Random, size: int) -> list[str]:
    """Prose, unicode, whitespace runs and special tokens, mixed."""
    docs, total = [], 0
    while total < size:
        parts = []
        for _ in range(rng.randint(20, 80)):
            kind = rng.random()
            if kind < 0.5:
                sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20)))
                parts.append(sentence.capitalize() + rng.choice(".!?;:,") + " ")
            elif kind < 0.8:
                pool = rng.choice(UNICODE_POOLS)
                start = rng.randrange(len(pool))
                parts.append(pool[start:start + rng.randint(1, 40)])
            elif kind < 0.9:
                parts.append(rng.choice([" ", "\t", "\n", "\r\n", "\u3000"]) * rng.randint(1, 200))
            else:
                parts.append(rng.choice(SPECIALS + NON_SPECIAL + ["<|endoftext|>"]))
        doc = "".join(parts)
        docs.append(doc)
        total += len(doc.encode("utf-8"))
    return docs


def train(kind: str, vocab_size: int, docs: list[str]):
    tok = tokenizers.Tokenizer(models.BPE())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif kind == "digits":                         # starcoder2 / granite
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(NON_SPECIAL)                    # non-special: matched even with special=False
    return tok


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    docs = stdlib_text(STDLIB[1::2], 700_000) + generated_text(random.Random(0), 400_000)
    assert sum(len(d.encode("utf-8")) for d in docs) >= 1_000_000
    return docs


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    docs = stdlib_text(STDLIB[::2], 1_000_000)
    out = {}
    for kind, size in (("gpt2", 2000), ("qwen", 8000), ("digits", 1000)):
        directory = tmp_path_factory.mktemp(f"{kind}{size}")
        hf = train(kind, size, docs)
        hf.save(str(directory / "tokenizer.json"))
        config = {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        out[kind] = (directory, hf)
    return out


@pytest.fixture(params=["gpt2", "qwen", "digits"])
def vocab(request, trained):
    directory, hf = trained[request.param]
    return directory, hf, load_tokenizer(directory)


def hf_ids(hf, docs: list[str]) -> list[list[int]]:
    return [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)]


def first_mismatch(tok: Tokenizer, hf, docs: list[str]):
    for doc, expected in zip(docs, hf_ids(hf, docs)):
        ids = tok.encode(doc)
        if ids != expected:
            k = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), len(ids))
            return doc, tok.decode(ids[max(0, k - 3):k + 3]), ids[k:k + 5], expected[k:k + 5]
    return None


def test_ids_match_hf_on_a_megabyte(vocab, corpus):
    _, hf, tok = vocab
    assert first_mismatch(tok, hf, corpus) is None


def test_special_false_matches_hf_split_special_tokens(vocab, corpus):
    _, hf, tok = vocab
    hf.encode_special_tokens = True
    try:
        expected = hf_ids(hf, corpus[-60:])
    finally:
        hf.encode_special_tokens = False
    assert [tok.encode(d, special=False) for d in corpus[-60:]] == expected


def test_decode_inverts_encode(vocab, corpus):
    _, _, tok = vocab
    for doc in corpus:
        expected = unicodedata.normalize("NFC", doc) if tok.normalizer else doc
        assert tok.decode(tok.encode(doc)) == expected


def test_decode_matches_hf_on_random_ids(vocab):
    _, hf, tok = vocab
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)


_LOADED: dict = {}


def load_tokenizer_cached(directory) -> Tokenizer:
    if directory not in _LOADED:
        _LOADED[directory] = load_tokenizer(directory)
    return _LOADED[directory]


PIECES = list("ab é\u0301 \n\t\r'Sx1²日😀\u3000") + SPECIALS + NON_SPECIAL + ["<|im_", "|>"]


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES) | st.text(max_size=3)))
def test_ids_match_hf_on_generated_strings(trained, pieces):
    text = "".join(pieces)
    for directory, hf in trained.values():
        tok = load_tokenizer_cached(directory)
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids


def test_tiktoken_save_load_round_trip(vocab, corpus, tmp_path):
    _, _, tok = vocab
    again = load_tokenizer(tok.save(tmp_path))
    assert (tmp_path / "tokenizer.tiktoken").is_file()
    assert [again.encode(d) for d in corpus[:50]] == [tok.encode(d) for d in corpus[:50]]
    assert [again.decode_bytes([i]) for i in range(tok.vocab_size)] == \
        [tok.decode_bytes([i]) for i in range(tok.vocab_size)]
    assert (again.special_tokens, again.added_tokens, again.eos_token_id, again.pad_token_id,
            again.vocab_size, again.normalizer) == \
        (tok.special_tokens, tok.added_tokens, tok.eos_token_id, tok.pad_token_id,
         tok.vocab_size, tok.normalizer)


def test_eos_and_pad_come_from_tokenizer_config(vocab):
    _, hf, tok = vocab
    assert (tok.eos_token_id, tok.pad_token_id) == \
        (hf.token_to_id("<|im_end|>"), hf.token_to_id("<|endoftext|>"))


def test_eos_falls_back_to_generation_config(trained, tmp_path):
    directory, _ = trained["gpt2"]
    (tmp_path / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0]}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.eos_token_id, tok.pad_token_id) == (7, None)


@pytest.fixture
def reversed_ids(trained, tmp_path):
    """The gpt2 vocabulary with its merged tokens' ids reversed (ids no longer merge order)."""
    directory, _ = trained["gpt2"]
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    order = iter(sorted((i for i in vocab.values() if i >= 257), reverse=True))  # bytes: 1..256
    spec["model"]["vocab"] = {t: (next(order) if i >= 257 else i)
                              for t, i in sorted(vocab.items(), key=lambda kv: kv[1])}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")), load_tokenizer(tmp_path)


def test_ids_out_of_merges_order_still_match_hf(reversed_ids, corpus):
    hf, tok = reversed_ids
    assert tok.rank_to_id is not None
    assert first_mismatch(tok, hf, corpus[::10]) is None


def test_ids_out_of_merges_order_survive_save_and_load(reversed_ids, corpus, tmp_path):
    _, tok = reversed_ids
    again = load_tokenizer(tok.save(tmp_path / "saved"))
    assert [again.encode(d) for d in corpus[::20]] == [tok.encode(d) for d in corpus[::20]]


def test_bare_tiktoken_reads_specials_and_eos_from_tokenizer_config(tmp_path):
    byte_level_tokenizer().save(tmp_path)
    (tmp_path / "tiktoken_config.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|end|>",
        "added_tokens_decoder": {"300": {"content": "<|end|>", "special": True}}}))
    tok = load_tokenizer(tmp_path / "tokenizer.tiktoken")
    assert (tok.encode("hi<|end|>"), tok.eos_token_id) == ([104, 105, 300], 300)


@pytest.mark.parametrize("flags", [dict(lstrip=True), dict(rstrip=True), dict(single_word=True),
                                   dict(lstrip=True, rstrip=True, single_word=True)])
@pytest.mark.parametrize("special", [True, False])
def test_added_token_flags_match_hf(trained, tmp_path, flags, special):
    directory, _ = trained["qwen"]
    hf = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    hf.add_tokens([AddedToken("<mask>", special=special, normalized=not special, **flags),
                   AddedToken("ﬁx", special=False, normalized=True)])   # NFC leaves ﬁ alone
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    texts = ["a <mask> b", "a<mask>b", "  <mask>  ", "_<mask>", "é<mask>\u0301", "1<mask>.",
             "<mask><mask>", "x\u3000<mask>\t\ny", "\u2028<mask>\x1c", "ﬁx fix ﬁx<mask>"]
    assert [tok.encode(t) for t in texts] == hf_ids(hf, texts)


@pytest.mark.parametrize("kind", ["WordPiece", "Unigram", "Metaspace"])
def test_unsupported_tokenizers_raise_naming_the_type(tmp_path, kind):
    if kind == "WordPiece":
        hf = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    elif kind == "Unigram":
        hf = tokenizers.Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0))
    else:
        hf = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
        hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=kind):
        load_tokenizer(tmp_path)


def test_load_accepts_a_file_or_its_directory(trained):
    directory, _ = trained["gpt2"]
    text = "def f(x):\n    return x  # <|im_end|>"
    assert load_tokenizer(directory / "tokenizer.json").encode(text) == \
        load_tokenizer(directory).encode(text)


def test_byte_level_tokenizer_counts_bytes_and_chatml_tokens():
    tok = byte_level_tokenizer()
    text = "<|im_start|>user\nhé 😀<|im_end|>\n"
    ids = tok.encode(text)
    assert ids == [257, *"user\nhé 😀".encode(), 258, 10]
    assert (tok.decode(ids), tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == \
        (text, 258, 256, 259)
