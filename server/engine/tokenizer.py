"""Tokenizer front-end: Hugging Face ``tokenizer.json`` via ``tokenizers``, or a byte fallback.

Two kinds (``Tokenizer.kind``):

* ``"tokenizers"``: the folder has a ``tokenizer.json``; encoding goes through
  the Rust ``tokenizers`` library. bos/eos come from ``tokenizer_config.json``
  (then ``special_tokens_map.json``), falling back to ``config.json``;
  ``eos_token_ids`` also collects ``config.json`` and
  ``generation_config.json`` eos ids (Llama 3 style multi-eos).
* ``"byte"``: no tokenizer files at all; token id = UTF-8 byte + 3, with
  0=``<unk>``, 1=``<s>``, 2=``</s>`` (vocab 259).

Decoding fast path: for the decoders whose output is a pure function of each
token's bytes (``ByteFallback``[+``Fuse``] optionally with Llama's
``Replace("▁", " ")``/``Strip`` pair, and GPT-2/Llama-3/Qwen ``ByteLevel``)
a per-id ``bytes`` table is built once; ``decode`` and the
``IncrementalDetokenizer`` then just join bytes and run Python's UTF-8 decoder
(``errors="replace"``). For valid UTF-8 this equals ``tokenizers``' decode; for
invalid byte runs it is more lenient than ``ByteFallback`` (which turns a whole
run of byte tokens into U+FFFD when any byte in it is invalid) and equals what
the incremental detokenizer streams, so streamed and non-streamed text agree.
Other decoders (WordPiece, Metaspace, ...) use ``tokenizers`` directly and a
windowed incremental detokenizer.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BYTE_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BYTE_OFFSET = len(BYTE_SPECIAL_TOKENS)
_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Encode/decode text for one model. Thread-safe for encode/decode; detokenizers are per request."""

    kind: str  # "tokenizers" or "byte"
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool
    chat_template: str | None
    special_token_ids: frozenset[int]

    def __init__(
        self,
        backend: Any = None,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
    ) -> None:
        """``backend`` is a ``tokenizers.Tokenizer``, or ``None`` for the byte tokenizer."""
        self._tok = backend
        self.chat_template = chat_template
        if backend is None:
            self.kind = "byte"
            self.vocab_size = BYTE_OFFSET + 256
            self.bos_token_id = 1 if bos_token_id is None else bos_token_id
            self.eos_token_id = 2 if eos_token_id is None else eos_token_id
            self.special_token_ids = frozenset(range(BYTE_OFFSET))
            self._special_content = {i: s for i, s in enumerate(BYTE_SPECIAL_TOKENS)}
            table: list[bytes] | None = [s.encode() for s in BYTE_SPECIAL_TOKENS] + [bytes([b]) for b in range(256)]
            self._strip_first_space = False
            self.add_bos_token = True if add_bos_token is None else add_bos_token
        else:
            self.kind = "tokenizers"
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
            self.bos_token_id = bos_token_id
            self.eos_token_id = eos_token_id
            added = backend.get_added_tokens_decoder()
            self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
            self._special_content = {i: added[i].content for i in self.special_token_ids}
            table, self._strip_first_space = _build_byte_table(backend)
            if add_bos_token is None:
                probe = backend.encode("", add_special_tokens=True).ids
                add_bos_token = bos_token_id is not None and probe[:1] == [bos_token_id]
            self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        ids: list[int] = []
        for e in [self.eos_token_id, *eos_token_ids]:
            if e is not None and e not in ids:
                ids.append(int(e))
        self.eos_token_ids = tuple(ids)
        if self.eos_token_id is None and ids:
            self.eos_token_id = ids[0]
        self._table = table
        if table is not None:
            skip = list(table)
            for i in self.special_token_ids:
                if i < len(skip):
                    skip[i] = b""
            self._skip_table: list[bytes] | None = skip
        else:
            self._skip_table = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def byte_tokenizer(cls) -> Tokenizer:
        return cls(None)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: tokenizer folder does not exist")
        cfg = _read_json(folder / "config.json")
        gen = _read_json(folder / "generation_config.json")
        tok_json = folder / "tokenizer.json"
        if not tok_json.is_file():
            other = [n for n in ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt") if (folder / n).exists()]
            if other:
                raise FileNotFoundError(
                    f"{folder}: has {', '.join(other)} but no tokenizer.json; create it once with "
                    "`transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`."
                )
            vocab = cfg.get("vocab_size")
            if isinstance(vocab, int) and vocab < BYTE_OFFSET + 256:
                raise ValueError(
                    f"{folder}: no tokenizer.json, and vocab_size={vocab} is too small for the "
                    f"byte fallback tokenizer (needs {BYTE_OFFSET + 256})."
                )
            log.warning("%s: no tokenizer.json; using the byte fallback tokenizer (id = byte + 3)", folder)
            return cls(None)

        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(tok_json))
        tcfg = _read_json(folder / "tokenizer_config.json")
        stm = _read_json(folder / "special_tokens_map.json")

        def special(name: str) -> int | None:
            for src in (tcfg, stm):
                if name in src:
                    content = src[name]
                    if isinstance(content, dict):
                        content = content.get("content")
                    if isinstance(content, str):
                        tid = backend.token_to_id(content)
                        if tid is not None:
                            return tid
            return None

        def cfg_ids(d: dict, key: str) -> list[int]:
            v = d.get(key)
            if isinstance(v, int):
                return [v]
            if isinstance(v, list):
                return [int(x) for x in v if isinstance(x, int)]
            return []

        bos = special("bos_token")
        if bos is None:
            bos = next(iter(cfg_ids(cfg, "bos_token_id") or cfg_ids(gen, "bos_token_id")), None)
        eos = special("eos_token")
        eos_all = ([eos] if eos is not None else []) + cfg_ids(cfg, "eos_token_id") + cfg_ids(gen, "eos_token_id")
        add_bos = tcfg.get("add_bos_token")
        template = tcfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"  # newer transformers save the template beside the config
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # list of {"name", "template"} dicts
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos_all[0] if eos_all else None,
            eos_token_ids=eos_all,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            chat_template=template if isinstance(template, str) else None,
        )

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``<bos>`` is prepended when ``add_bos`` and the tokenizer uses one.

        Only ``<bos>`` is ever added (no eos / template suffixes), so a prompt
        can be continued by the model.
        """
        if self._tok is None:
            ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
        if self._tok is None:
            return [self.encode(t, add_bos) for t in texts]
        out = [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        if add_bos and self.add_bos_token:
            for ids in out:
                ids.insert(0, self.bos_token_id)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        table = self._skip_table if skip_special_tokens else self._table
        if table is None:
            return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        n = len(table)
        data = b"".join([table[i] if 0 <= i < n else b"" for i in ids])
        if self._strip_first_space and data[:1] == b" ":
            data = data[1:]
        return data.decode("utf-8", "replace")

    def incremental_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        if self._tok is None:
            if token in BYTE_SPECIAL_TOKENS:
                return BYTE_SPECIAL_TOKENS.index(token)
            m = _BYTE_TOKEN_RE.fullmatch(token)
            return int(m.group(1), 16) + BYTE_OFFSET if m else None
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if self._tok is None:
            if 0 <= token_id < BYTE_OFFSET:
                return BYTE_SPECIAL_TOKENS[token_id]
            if BYTE_OFFSET <= token_id < self.vocab_size:
                return f"<0x{token_id - BYTE_OFFSET:02X}>"
            return None
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes token ``token_id`` stands for (a byte-level piece of a multi-byte character is that
        byte, not U+FFFD), or None when the decoder has no byte table (then only its text is known)."""
        table = self._table
        if table is None or not 0 <= token_id < len(table):
            return None
        return table[token_id]

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, fast_decode={self._table is not None})"
        )


class IncrementalDetokenizer:
    """Per-request streaming detokenizer.

    ``push(token_id)`` returns the text that became complete with this token
    (often ``""`` while a multi-byte character is still being assembled);
    ``flush()`` returns whatever is still held back (an incomplete trailing
    UTF-8 sequence becomes U+FFFD). The concatenation of all pushes and the
    final flush equals ``tokenizer.decode(all_ids)``.
    """

    __slots__ = ("_table", "_n", "_dec", "_strip", "_tok", "_skip", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        table = tokenizer._skip_table if skip_special_tokens else tokenizer._table
        self._table = table
        self._n = len(table) if table is not None else 0
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip = tokenizer._strip_first_space
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        table = self._table
        if table is not None:
            if not 0 <= token_id < self._n:
                return ""
            data = table[token_id]
            if not data:
                return ""
            if self._strip:
                self._strip = False
                if data[:1] == b" ":
                    data = data[1:]
            return self._dec.decode(data)
        return self._push_windowed(token_id)

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join([self.push(t) for t in token_ids])

    def flush(self) -> str:
        if self._table is not None:
            return self._dec.decode(b"", True)
        ids = self._ids
        if self._read >= len(ids):
            return ""
        decode = self._tok._tok.decode
        prefix_text = decode(ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = decode(ids[self._prefix :], skip_special_tokens=self._skip)
        self._ids = []
        self._prefix = self._read = 0
        return new_text[len(prefix_text) :]

    def _push_windowed(self, token_id: int) -> str:
        # vLLM-style: decode a short window twice and emit the difference once it
        # no longer ends in an incomplete character.
        ids = self._ids
        ids.append(token_id)
        decode = self._tok._tok.decode
        prefix_text = decode(ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = decode(ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            # Keep only the tokens still needed as left context.
            del ids[: self._read]
            self._prefix = 0
            self._read = len(ids)
            return delta
        return ""


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return d if isinstance(d, dict) else {}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char map used by ByteLevel."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _decoder_plan(decoder: dict | None) -> tuple[str, bool, bool] | None:
    """(mode, replace_metaspace, strip_first_space) when the decoder is byte-table friendly."""
    if not isinstance(decoder, dict):
        return None
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    if not isinstance(steps, list) or not steps:
        return None
    types = [s.get("type") if isinstance(s, dict) else None for s in steps]
    if types == ["ByteLevel"]:
        return ("bytelevel", False, False)
    replace = False
    i = 0
    if types[i] == "Replace":
        s = steps[i]
        if s.get("pattern") != {"String": "\u2581"} or s.get("content") != " ":
            return None
        replace = True
        i += 1
    if i >= len(types) or types[i] != "ByteFallback":
        return None
    i += 1
    fused = False
    if i < len(types) and types[i] == "Fuse":
        fused = True
        i += 1
    strip = False
    if i < len(types) and types[i] == "Strip":
        s = steps[i]
        if not fused or s.get("content") != " " or s.get("start") != 1 or s.get("stop") != 0:
            return None
        strip = True
        i += 1
    if i != len(types):
        return None
    return ("bytefallback", replace, strip)


def _build_byte_table(backend: Any) -> tuple[list[bytes] | None, bool]:
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except Exception:  # pragma: no cover - defensive: unknown serialisation
        return None, False
    plan = _decoder_plan(decoder)
    if plan is None:
        return None, False
    mode, replace, strip = plan
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    table = [b""] * size
    if mode == "bytelevel":
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        for tok, i in vocab.items():
            try:
                table[i] = bytes([inv[c] for c in tok])
            except KeyError:
                table[i] = tok.encode("utf-8")
    else:
        for tok, i in vocab.items():
            m = _BYTE_TOKEN_RE.fullmatch(tok)
            if m:
                table[i] = bytes([int(m.group(1), 16)])
            else:
                table[i] = (tok.replace("\u2581", " ") if replace else tok).encode("utf-8")
    return table, strip
