"""Structured outputs: JSON-schema grammars (llguidance), their compile cost and size limits."""
