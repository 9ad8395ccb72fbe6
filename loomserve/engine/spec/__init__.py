"""Speculative decoding: drafters that propose tokens, and their bookkeeping in the core."""
