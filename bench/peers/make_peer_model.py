#!/usr/bin/env python
"""Create the tiny random Llama used to compare distserve with vLLM (CPU build).

Usage: make_peer_model.py OUT_DIR

The folder is the one the team agreed to compare on (same shape, seed and tokenizer on both servers):
  * Hugging Face Llama, hidden 256, intermediate 688, 4 layers, 4 heads, 4 KV heads,
    vocab 512, max positions 2048, float32, random weights from torch.manual_seed(0),
    written with save_pretrained (safetensors);
  * a byte-fallback BPE tokenizer: <unk>=0, <s>=1, </s>=2, the 256 byte tokens <0x00>..<0xFF>
    at ids 3..258, no merges, a ByteFallback decoder, padded with filler tokens up to the
    model vocab (512) so tokenizer vocab == model vocab; saved through PreTrainedTokenizerFast.
    The fillers (ids 259..511) are single characters: U+FFFD, then the private-use U+F0000..
    U+F00FB, so that decoding random non-special ids and encoding the text again gives back as
    many tokens (what vLLM's random dataset needs to produce prompts of the asked length).
"""

from __future__ import annotations

import json
import os
import sys

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>"]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)  # ids 3..258
    assert vocab["<0x00>"] == 3 and vocab["<0xFF>"] == 258
    # Filler tokens so the tokenizer vocab is exactly the model vocab. Each is ONE character,
    # so decode -> encode maps it back to itself (one token), and the first is U+FFFD, the
    # character ByteFallback emits for every byte token of an invalid UTF-8 run, so such a
    # run also re-encodes to as many tokens as it had. That makes decode/encode length-
    # preserving for every non-special id, which vLLM's random dataset relies on to hit
    # --random-input-len exactly (multi-character fillers like "<extra_0>" re-encode to ~11
    # byte tokens and inflated its 128-token prompts to ~218 on average).
    # The rest are 4-byte private-use characters (U+F0000..), so a random run of byte tokens
    # almost never spells one (which would re-encode to 1 token instead of 4).
    fillers = ["\ufffd"] + [chr(0xF0000 + i) for i in range(VOCAB - len(vocab) - 1)]
    for ch in fillers:
        vocab[ch] = len(vocab)
    assert len(vocab) == VOCAB

    bpe = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    # No pre-tokenizer and no normalizer: with no merges, BPE looks every character up on its
    # own and byte_fallback turns each one that is not a vocab entry into its UTF-8 bytes.
    tok = Tokenizer(bpe)
    tok.decoder = decoders.ByteFallback()
    tok.add_special_tokens(SPECIALS)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    return fast


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    return model


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    out = argv[1]
    os.makedirs(out, exist_ok=True)

    tok = build_tokenizer()
    assert len(tok) == VOCAB, len(tok)
    model = build_model()

    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)

    # Self-check: byte fallback round-trips arbitrary UTF-8, ids stay inside the vocab.
    from transformers import AutoTokenizer

    t2 = AutoTokenizer.from_pretrained(out)
    text = "Hello, wörld! 你好"
    ids = t2.encode(text, add_special_tokens=False)
    assert all(3 <= i <= 258 for i in ids), ids
    assert t2.decode(ids) == text, t2.decode(ids)
    assert len(t2) == VOCAB
    # decode -> encode keeps the token count for any non-special ids (see the fillers above).
    import random

    rng = random.Random(0)
    for _ in range(200):
        seq = [rng.randrange(3, VOCAB) for _ in range(128)]
        again = t2.encode(t2.decode(seq), add_special_tokens=False)
        assert len(again) == len(seq), (len(again), seq)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    nparams = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {out}: llama hidden={cfg['hidden_size']} layers={cfg['num_hidden_layers']} "
        f"vocab={cfg['vocab_size']} params={nparams / 1e6:.2f}M tokenizer_vocab={len(t2)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
