"""Decoding: one backbone pass per step, drafts proposed and accepted by a strategy."""
