"""Checkpoints: Hugging Face directories, GGUF files and tiny random models, loaded into a ``LanguageModel``."""
