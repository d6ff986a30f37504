"""Speculative decoding: n-gram and draft-model proposers, acceptance bookkeeping."""
