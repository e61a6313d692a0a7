"""The backbone (mlx-lm's Qwen2) and the drafters trained for it: MTP heads, CLP,
the gate and head 0, with their files and backbone fingerprints."""
