"""Structured output: JSON schemas, regexes, choices and grammars compiled to token masks with
llguidance, shared by the API process (validating a constraint) and the engine (masking logits).
No torch."""
