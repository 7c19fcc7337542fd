"""The tokenizer of the MoE engine: one tiktoken-backed byte-level BPE for every checkpoint.

`load_tokenizer(path)` reads a checkpoint's Hugging Face `tokenizer.json` (byte-level BPE:
GPT-2, Qwen2, Llama-3, OLMoE style) or a `*.tiktoken` file with an optional
`tiktoken_config.json` sidecar, and returns a `Tokenizer` whose ids are identical to what
HF `tokenizers` produces with `add_special_tokens=False`:

- ranks come from the vocab ids when the ids follow the merges order; otherwise they are
  derived from the merges order and mapped back to ids (`Tokenizer.rank_to_id`);
- the pre-tokenizer regex comes from a `Split` (Isolated), from `ByteLevel(use_regex=True)`,
  or from `Digits` followed by `ByteLevel(use_regex=True)` (starcoder2, granite);
- added tokens are matched the way HF does (leftmost-longest, `lstrip`/`rstrip`/`single_word`,
  `normalized` tokens matched after normalization); non-special added tokens are always
  matched, special ones only with `encode(..., special=True)` (HF's `split_special_tokens`);
- NFC/NFD/NFKC/NFKD normalizers are applied per segment between added tokens, as HF does.

`byte_level_tokenizer()` is the model-free tokenizer (256 byte tokens plus ChatML specials)
that the scripted replay policy counts with.

It does not train tokenizers, add BOS/EOS (post-processors are ignored), or read WordPiece,
Unigram or sentencepiece-style BPE: those raise `ValueError` naming what is unsupported.
"""

from __future__ import annotations

import base64
import json
import re
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import tiktoken

TIKTOKEN_FILE = "tokenizer.tiktoken"
SIDECAR_FILE = "tiktoken_config.json"
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# The regex HF's ByteLevel pre-tokenizer uses with use_regex=True (GPT-2's).
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2's regex on text whose numbers are already split off: whitespace ends before a number.
_GPT2_BETWEEN_DIGITS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
# Qwen2's split regex: the default for a bare .tiktoken file without a sidecar.
DEFAULT_PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                   r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

_NORMALIZATION_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
# Unicode White_Space, which is what `\s` means in the Rust regex crate HF uses for lstrip/rstrip.
_WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005"
                        "\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_WORD_CATEGORIES = frozenset({"Lu", "Ll", "Lt", "Lm", "Lo", "Nl", "Mn", "Mc", "Me", "Nd", "Pc"})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character (HF ByteLevel)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(chars.items()))


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def _byte_level_bytes(token: str) -> bytes | None:
    """A byte-level vocab string's bytes, or None when a character is outside the map."""
    try:
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    except KeyError:
        return None


def _decoded_bytes(token: str) -> bytes:
    """What HF's ByteLevel decoder emits for one token string (raw UTF-8 if not byte-level)."""
    raw = _byte_level_bytes(token)
    return token.encode("utf-8") if raw is None else raw


@dataclass(frozen=True)
class AddedToken:
    """One entry of HF's `added_tokens`, with the flags that change how text is matched."""
    content: str
    id: int
    special: bool = True       # matched only when encode(special=True); skipped by skip_special
    normalized: bool = False   # matched in normalized text rather than raw text
    lstrip: bool = False       # the match swallows whitespace on its left
    rstrip: bool = False       # the match swallows whitespace on its right
    single_word: bool = False  # only matched when not touching word characters


class _AddedMatcher:
    """Finds added tokens in text exactly like HF's AddedVocabulary.find_matches."""

    def __init__(self, tokens: Iterable[AddedToken], normalize=lambda s: s):
        self.by_text = {normalize(t.content): t for t in tokens if t.content}
        alternatives = sorted(self.by_text, key=len, reverse=True)   # leftmost-longest
        self.regex = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def split(self, text: str, special: bool) -> list[str | int]:
        """`text` as plain segments (str) and added token ids (int), in order."""
        if self.regex is None:
            return [text] if text else []
        pieces: list[str | int] = []
        done = 0
        for match in self.regex.finditer(text):
            start, stop = match.span()
            token = self.by_text[match.group()]
            if token.special and not special:
                continue
            if token.single_word and ((start > 0 and _is_word(text[start - 1]))
                                      or (stop < len(text) and _is_word(text[stop]))):
                continue
            if token.lstrip:
                while start > done and text[start - 1] in _WHITESPACE:
                    start -= 1
            if token.rstrip:
                while stop < len(text) and text[stop] in _WHITESPACE:
                    stop += 1
            if done < start:
                pieces.append(text[done:start])
            pieces.append(token.id)
            done = stop
        if done < len(text):
            pieces.append(text[done:])
        return pieces


def _is_word(char: str) -> bool:
    # Rust regex `\w`: Alphabetic, marks, decimal digits, connector punctuation, joiners.
    return unicodedata.category(char) in _WORD_CATEGORIES or char in "\u200c\u200d"


class Tokenizer:
    """Byte-level BPE over a tiktoken `Encoding`, with HF's added-token semantics."""

    def __init__(self, encoding: tiktoken.Encoding, *, added_tokens: Iterable[AddedToken] = (),
                 normalizer: Sequence[str] = (), rank_to_id: Sequence[int] | None = None,
                 decode_overrides: Mapping[int, bytes] | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None):
        self.encoding = encoding                       # ranks are ids unless rank_to_id is set
        self.added_tokens = tuple(added_tokens)
        self.normalizer = tuple(normalizer)            # unicode normalization forms, in order
        for form in self.normalizer:
            if form not in _NORMALIZATION_FORMS:
                raise ValueError(f"unsupported normalizer {form!r}; expected one of "
                                 f"{', '.join(_NORMALIZATION_FORMS)}")
        self.rank_to_id = list(rank_to_id) if rank_to_id is not None else None
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.special_tokens = {t.content: t.id for t in self.added_tokens if t.special}
        self._special_ids = frozenset(self.special_tokens.values())
        self._raw = _AddedMatcher(t for t in self.added_tokens if not t.normalized)
        self._normalized = _AddedMatcher((t for t in self.added_tokens if t.normalized),
                                         self._normalize)
        self._decode_overrides = dict(decode_overrides or {})
        self._id_to_bytes = self._decode_table()

    def _decode_table(self) -> list[bytes]:
        table: dict[int, bytes] = {}
        for token, rank in self.encoding._mergeable_ranks.items():
            table[self._id(rank)] = token
        for t in self.added_tokens:
            table[t.id] = t.content.encode("utf-8")
        table.update(self._decode_overrides)
        out = [b""] * (max(table) + 1 if table else 0)   # ids without a token decode to nothing
        for i, token in table.items():
            out[i] = token
        return out

    def _id(self, rank: int) -> int:
        return rank if self.rank_to_id is None else self.rank_to_id[rank]

    def _normalize(self, text: str) -> str:
        for form in self.normalizer:
            text = unicodedata.normalize(form, text)
        return text

    def _encode_plain(self, text: str) -> list[int]:
        ranks = self.encoding.encode_ordinary(text)
        if self.rank_to_id is None:
            return ranks
        return [self.rank_to_id[r] for r in ranks]

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text` (never adds BOS/EOS). With special=False, special tokens in the
        text are encoded as plain text; non-special added tokens are matched either way."""
        if not self.added_tokens and not self.normalizer:
            return self._encode_plain(text)
        ids: list[int] = []
        for piece in self._raw.split(text, special):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            for sub in self._normalized.split(self._normalize(piece), special):
                if isinstance(sub, int):
                    ids.append(sub)
                else:
                    ids.extend(self._encode_plain(sub))
        return ids

    def token_count(self, text: str, special: bool = True) -> int:
        return len(self.encode(text, special))

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """The bytes of `ids`; ids outside the vocabulary decode to nothing, as in HF."""
        ids = list(map(int, ids))
        table, n = self._id_to_bytes, len(self._id_to_bytes)
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        if ids and 0 <= min(ids) and max(ids) < n:
            return b"".join(map(table.__getitem__, ids))
        return b"".join(table[i] for i in ids if 0 <= i < n)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        """Largest token id + 1 (the embedding rows a model needs at least)."""
        return len(self._id_to_bytes)

    def save(self, directory: str | Path) -> Path:
        """Write `tokenizer.tiktoken` and `tiktoken_config.json`; `load_tokenizer` reads them back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ranks = sorted(self.encoding._mergeable_ranks.items(), key=lambda kv: kv[1])
        lines = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks)
        (directory / TIKTOKEN_FILE).write_text(lines, encoding="utf-8")
        implied = {t.id: t.content.encode("utf-8") for t in self.added_tokens}
        implied.update((self._id(r), tok) for tok, r in ranks)
        overrides = {str(i): base64.b64encode(tok).decode()
                     for i, tok in enumerate(self._id_to_bytes)
                     if tok and implied.get(i) != tok}
        sidecar = {"pat_str": self.encoding._pat_str, "normalizer": list(self.normalizer),
                   "added_tokens": [asdict(t) for t in self.added_tokens],
                   "rank_to_id": self.rank_to_id, "decode_overrides": overrides,
                   "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}
        (directory / SIDECAR_FILE).write_text(json.dumps(sidecar, ensure_ascii=False, indent=1),
                                              encoding="utf-8")
        return directory

    def __repr__(self) -> str:
        return (f"Tokenizer({self.encoding.name!r}, vocab_size={self.vocab_size}, "
                f"added={len(self.added_tokens)}, eos={self.eos_token_id})")


def _make_encoding(name: str, pat_str: str, ranks: dict[bytes, int], added: Sequence[AddedToken],
                   rank_to_id: Sequence[int] | None) -> tuple[tiktoken.Encoding, list[int] | None]:
    """The tiktoken Encoding, with the added tokens as its special tokens, and the rank_to_id
    covering them. `Tokenizer` matches added tokens itself; they are here for `.encoding` users."""
    if rank_to_id is None:  # ids are ranks; an added token that is also a vocab token stays out
        taken = set(ranks.values())
        specials = {t.content: t.id for t in added if t.id not in taken}
    else:
        rank_to_id = list(rank_to_id[:len(ranks)])
        specials = {t.content: len(rank_to_id) + i for i, t in enumerate(added)}
        rank_to_id += [t.id for t in added]
    try:
        encoding = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=specials)
    except ValueError as e:
        raise ValueError(f"{name}: tiktoken rejected the pre-tokenizer regex {pat_str!r}: {e}") from e
    return encoding, rank_to_id


# -- tokenizer.json -------------------------------------------------------------------------

def _pat_str(pre: dict | None) -> str:
    """The one splitting regex of a byte-level pre-tokenizer, in tiktoken's dialect."""
    steps = (pre or {}).get("pretokenizers", []) if (pre or {}).get("type") == "Sequence" else [pre]
    types = [s.get("type") if s else None for s in steps]
    if not steps or types[-1] != "ByteLevel":
        raise ValueError(f"pre-tokenizer {types} is not byte-level (need ByteLevel last); "
                         "only byte-level BPE tokenizers are supported")
    *splits, byte_level = steps
    if byte_level.get("add_prefix_space"):
        raise ValueError("ByteLevel pre-tokenizer with add_prefix_space=True is not supported")
    if [s.get("type") if s else None for s in splits] == ["Digits"] and \
            byte_level.get("use_regex", True):
        # starcoder2/granite: numbers are split off first, then GPT-2's regex runs on the rest
        digits = r"\p{N}" if splits[0].get("individual_digits") else r"\p{N}+"
        return f"{digits}|{_GPT2_BETWEEN_DIGITS}"
    regexes = [GPT2_PAT_STR] if byte_level.get("use_regex", True) else []
    for step in splits:
        if step.get("type") != "Split":
            raise ValueError(f"unsupported pre-tokenizer {step.get('type')!r} in {types}")
        if step.get("behavior") != "Isolated" or step.get("invert"):
            raise ValueError(f"unsupported Split behaviour {step.get('behavior')!r} "
                             f"(invert={step.get('invert')}); only Isolated is supported")
        pattern = step["pattern"]
        regex = pattern["Regex"] if "Regex" in pattern else _literal(pattern["String"])
        # HF keeps the text between matches as pieces too; tiktoken only sees matches.
        regexes.append(f"{regex}|(?:(?:(?!{regex})[\\s\\S])+)")
    if len(regexes) > 1:
        raise ValueError(f"pre-tokenizer {types} splits with {len(regexes)} regexes; "
                         "tiktoken supports exactly one")
    return regexes[0] if regexes else r"[\s\S]+"


def _literal(text: str) -> str:
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _normalizer_forms(spec: dict | None) -> tuple[str, ...]:
    if spec is None:
        return ()
    kind = spec.get("type")
    if kind == "Sequence":
        return tuple(f for step in spec.get("normalizers", []) for f in _normalizer_forms(step))
    if kind in _NORMALIZATION_FORMS:
        return (kind,)
    raise ValueError(f"unsupported normalizer {kind!r}; only NFC/NFD/NFKC/NFKD are supported")


def _check_decoder(spec: dict | None) -> None:
    steps = spec.get("decoders", []) if spec and spec.get("type") == "Sequence" else [spec]
    types = [s.get("type") if s else None for s in steps]
    if types != ["ByteLevel"]:
        raise ValueError(f"decoder {types} is not a ByteLevel decoder; "
                         "only byte-level BPE tokenizers are supported")


def _bpe_ranks(vocab: dict[str, int], merges: list) -> tuple[dict[bytes, int], list[int] | None]:
    """Mergeable ranks from HF's vocab and merges; rank_to_id is None when ranks are the ids.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; HF merges the
    pair that comes first in `merges`. They agree when the merge results' ranks follow the
    merges order. Vocab tokens that are neither single bytes nor merge results are left out
    (BPE can never produce them) and only decode. What tiktoken cannot express: a pair whose
    concatenation is a vocab token but which `merges` does not list (and, with
    `ignore_merges=False`, a whole piece that is a vocab token BPE would not reach). Vocabularies
    trained by BPE or converted from tiktoken do not hit these in practice; the tests compare
    with HF on 1 MB of text for three trained vocabularies.
    """
    single = [bytes_to_unicode()[b] for b in range(256)]
    missing = [b for b, char in enumerate(single) if char not in vocab]
    if missing:
        raise ValueError(f"byte-level vocab lacks {len(missing)} single-byte tokens "
                         f"(bytes {missing[:8]}...); tiktoken needs all 256")
    results: dict[str, None] = {}                  # merge results, in first-merge order
    for i, merge in enumerate(merges):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise ValueError(f"merge #{i} ({left!r}, {right!r}) uses or makes a token that "
                             "is not in the vocab")
        if _byte_level_bytes(left + right) is None:
            raise ValueError(f"merge #{i} makes {left + right!r}, which is not byte-level")
        results.setdefault(left + right)
    results_in_order = [t for t in results if t not in single]
    ids = [vocab[t] for t in results_in_order]
    if all(a < b for a, b in zip(ids, ids[1:])):
        ranks = {bytes([b]): vocab[char] for b, char in enumerate(single)}
        ranks.update((_byte_level_bytes(t), vocab[t]) for t in results_in_order)
        return ranks, None
    ranks = {bytes([b]): b for b in range(256)}    # ids out of merges order: derive ranks
    rank_to_id = [vocab[char] for char in single]
    for t in results_in_order:
        ranks[_byte_level_bytes(t)] = len(rank_to_id)
        rank_to_id.append(vocab[t])
    return ranks, rank_to_id


def _from_tokenizer_json(path: Path) -> Tokenizer:
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind != "BPE":
        raise ValueError(f"{path}: tokenizer model type {kind!r} is not supported; "
                         "only byte-level BPE tokenizers are")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise ValueError(f"{path}: BPE with {key}={model[key]!r} is not supported")
    try:
        pat_str = _pat_str(spec.get("pre_tokenizer"))
        _check_decoder(spec.get("decoder"))
        normalizer = _normalizer_forms(spec.get("normalizer"))
        vocab = model["vocab"]
        ranks, rank_to_id = _bpe_ranks(vocab, model.get("merges", []))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    added = [AddedToken(t["content"], t["id"], t.get("special", False),
                        t.get("normalized", not t.get("special", False)),
                        t.get("lstrip", False), t.get("rstrip", False),
                        t.get("single_word", False))
             for t in spec.get("added_tokens", [])]
    mergeable = {r if rank_to_id is None else rank_to_id[r] for r in ranks.values()}
    overrides = {i: _decoded_bytes(tok) for tok, i in vocab.items() if i not in mergeable}
    overrides.update((t.id, _decoded_bytes(t.content)) for t in added)
    names = {**{tok: i for tok, i in vocab.items()}, **{t.content: t.id for t in added}}
    eos, pad = _eos_pad(path.parent, names)
    encoding, rank_to_id = _make_encoding(path.parent.name or path.stem, pat_str, ranks, added,
                                          rank_to_id)
    return Tokenizer(encoding, added_tokens=added, normalizer=normalizer, rank_to_id=rank_to_id,
                     decode_overrides=overrides, eos_token_id=eos, pad_token_id=pad)


def _eos_pad(directory: Path, names: Mapping[str, int]) -> tuple[int | None, int | None]:
    """eos/pad ids from tokenizer_config.json, falling back to generation_config.json."""
    config = _read_json(directory / "tokenizer_config.json")
    generation = _read_json(directory / "generation_config.json")

    def resolve(key: str) -> int | None:
        token = config.get(f"{key}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token in names:
            return names[token]
        value = generation.get(f"{key}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        return value if isinstance(value, int) else None

    return resolve("eos"), resolve("pad")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# -- .tiktoken ------------------------------------------------------------------------------

def _from_tiktoken(path: Path) -> Tokenizer:
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: expected 'BASE64 RANK', got {line[:60]!r}") from e
    sidecar = _read_json(path.parent / SIDECAR_FILE)
    if sidecar:
        added = [AddedToken(**t) for t in sidecar.get("added_tokens", [])]
    else:   # a bare .tiktoken: special tokens may be listed HF-style in tokenizer_config.json
        decoder = _read_json(path.parent / "tokenizer_config.json").get("added_tokens_decoder", {})
        added = [AddedToken(t["content"], int(i), t.get("special", True),
                            t.get("normalized", False), t.get("lstrip", False),
                            t.get("rstrip", False), t.get("single_word", False))
                 for i, t in decoder.items()]
    overrides = {int(i): base64.b64decode(b) for i, b in sidecar.get("decode_overrides", {}).items()}
    if "eos_token_id" in sidecar:
        eos, pad = sidecar["eos_token_id"], sidecar.get("pad_token_id")
    else:
        names = {t.content: t.id for t in added}
        for token, rank in ranks.items():
            names.setdefault(token.decode("utf-8", errors="replace"), rank)
        eos, pad = _eos_pad(path.parent, names)
    encoding, rank_to_id = _make_encoding(path.stem, sidecar.get("pat_str", DEFAULT_PAT_STR),
                                          ranks, added, sidecar.get("rank_to_id"))
    return Tokenizer(encoding, added_tokens=added, normalizer=sidecar.get("normalizer", ()),
                     rank_to_id=rank_to_id, decode_overrides=overrides,
                     eos_token_id=eos, pad_token_id=pad)


# -- entry points ---------------------------------------------------------------------------

def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory, a `tokenizer.json` or a `*.tiktoken` file."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "tokenizer.json", path / TIKTOKEN_FILE, *sorted(path.glob("*.tiktoken"))]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path}: no tokenizer.json or *.tiktoken file")
        path = found
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    if path.suffix == ".tiktoken":
        return _from_tiktoken(path)
    if path.suffix == ".json":
        return _from_tokenizer_json(path)
    raise ValueError(f"{path}: expected a tokenizer.json or a .tiktoken file")


def byte_level_tokenizer(special_tokens: Sequence[str] | Mapping[str, int] = CHATML_SPECIAL_TOKENS
                         ) -> Tokenizer:
    """A model-free tokenizer: the 256 single bytes (no merges) plus special tokens (ids from
    256 unless given as a mapping). eos is `<|im_end|>` and pad `<|endoftext|>` when present."""
    if not isinstance(special_tokens, Mapping):
        special_tokens = {s: 256 + i for i, s in enumerate(special_tokens)}
    added = [AddedToken(s, i) for s, i in special_tokens.items()]
    ranks = {bytes([b]): b for b in range(256)}
    encoding, _ = _make_encoding("byte_level", DEFAULT_PAT_STR, ranks, added, None)
    return Tokenizer(encoding, added_tokens=added,
                     eos_token_id=special_tokens.get("<|im_end|>"),
                     pad_token_id=special_tokens.get("<|endoftext|>"))
