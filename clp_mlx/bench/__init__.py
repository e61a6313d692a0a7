"""The benchmark: named decode methods, prompts, and the report."""
