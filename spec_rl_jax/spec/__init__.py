"""Speculative decoding: proposers draft, the target verifies, the rejection sampler
keeps the output distribution exactly the target's (see verifier.py)."""
