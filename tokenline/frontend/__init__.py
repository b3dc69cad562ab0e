"""Tokenizers, chat templates, incremental detokenization and stop strings. No HTTP."""
