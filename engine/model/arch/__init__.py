"""The model's shape: ``ModelArch`` and the adapters that build it from a Hugging Face config."""
