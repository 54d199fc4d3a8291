"""Everything that runs inside one worker; never imports ray."""


def __getattr__(name: str):  # lazy: `engine.LLM` without importing torch for kv_cache users
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
