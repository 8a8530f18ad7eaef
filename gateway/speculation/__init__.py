"""Speculative decoding at the head: drafters, which one a choice gets, and exact verification."""
