"""The model families: one ``LanguageModel`` base and the layers each family stacks on it."""
