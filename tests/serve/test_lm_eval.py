"""lm-evaluation-harness's ``local-completions`` model against the ``bytes`` application: it finds
the server's tokenizer through ``/tokenizer_info`` and ``/tokenize`` (no download), scores a
multiple-choice task of our own (``tests/data/lm_eval_tasks/kvfleet_mc.yaml``) through
``/v1/completions`` with ``echo`` and ``logprobs``, and reports the accuracy that Hugging Face's
log-likelihoods of the same checkpoint give."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve.conftest import Server

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "lm_eval_tasks"
TASK = "kvfleet_mc"


class _Records(logging.Handler):
    """Keeps the messages logged to it (lm_eval's logger does not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lm_eval_log() -> Iterator[_Records]:
    records = _Records()
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.INFO)  # the model is built before simple_evaluate sets lm_eval's level
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def hf_choice_loglikelihoods(checkpoint: str, docs: list[dict[str, object]]) -> list[list[float]]:
    """Per document, each choice's summed log-probability given the question, as lm_eval's
    causal models split it: the question and the question plus ``" " + choice`` each tokenized
    without special tokens, the continuation the ids past the question's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    scores = []
    for doc in docs:
        question = str(doc["question"])
        context = tokenizer.encode(question, add_special_tokens=False)
        row = []
        for choice in doc["choices"]:  # type: ignore[attr-defined]
            whole = tokenizer.encode(f"{question} {choice}", add_special_tokens=False)
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            row.append(sum(logprobs[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
        scores.append(row)
    return scores


def test_lm_eval_local_completions_reports_hfs_accuracy(
    byte_server: Server, lm_eval_log: _Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the task's data_files path is the repository's
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": byte_server.model,
            "base_url": f"{byte_server.base}/v1/completions",
            "tokenizer_backend": "auto",
            "auth_token": byte_server.api_key,  # /tokenizer_info, /tokenize, /detokenize
            "header": byte_server.headers(),  # /v1/completions
            "num_concurrent": 4,
            "max_retries": 1,
            "max_length": byte_server.get(f"/v1/models/{byte_server.model}").json()["max_model_len"],
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASKS)),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert results is not None

    logged = "\n".join(lm_eval_log.messages)
    assert "Auto-detected remote tokenizer support" in logged, logged
    assert "Remote tokenizer not supported" not in logged and "Using tokenizer remote" in logged

    docs = [json.loads(line) for line in (TASKS / f"{TASK}.jsonl").read_text().splitlines()]
    expected = hf_choice_loglikelihoods(byte_server.config.model.source, docs)
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(docs)))
    hf_picks = [max(range(len(row)), key=row.__getitem__) for row in expected]
    for sample, hf_row, pick, doc in zip(samples, expected, hf_picks, docs, strict=True):
        served_row = [loglikelihood for loglikelihood, _greedy in sample["filtered_resps"]]
        assert served_row == pytest.approx(hf_row, abs=1e-3), doc
        assert sample["acc"] == float(pick == doc["answer"]), doc

    hf_accuracy = sum(pick == doc["answer"] for pick, doc in zip(hf_picks, docs, strict=True)) / len(docs)
    assert results["results"][TASK]["acc,none"] == hf_accuracy, (results["results"][TASK], hf_accuracy)
