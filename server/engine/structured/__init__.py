"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF) → per-row token masks, through llguidance.

``grammar.py`` turns a request's constraint into an llguidance grammar (pure, no tokenizer);
``decoding.py`` owns the per-request matchers of one engine and masks a step's logits before the
sampler runs (``StructuredDecoding.mask_logits``, the one call the engine makes).
"""
