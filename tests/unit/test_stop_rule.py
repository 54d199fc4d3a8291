"""One stop rule for the engine and the driver: ``engine.request.stop_status`` decides when a
request is done, both for the engine's own requests and for a stream the driver must decide
about after its worker died (``StreamedOutput.done_reason``: run it again, or it is complete)."""

from __future__ import annotations

import pytest

from actors.worker_types import TokenChunk
from cluster.request_runner import StreamedOutput
from engine.request import Request, RequestStatus, stop_status
from engine.sampling_params import SamplingParams
from engine.tokenizer import ByteTokenizer, IncrementalDetokenizer

EOS = 2


def streamed(sampling: SamplingParams, tokens: list[int]) -> StreamedOutput:
    output = StreamedOutput(IncrementalDetokenizer(ByteTokenizer(), sampling.stop, False), sampling)
    output.add(TokenChunk(tokens))
    return output


CASES = [
    # (sampling, output tokens, expected finish reason)
    (SamplingParams(max_tokens=8), [70, 71], None),
    (SamplingParams(max_tokens=8), [70, EOS], "stop"),
    (SamplingParams(max_tokens=8, ignore_eos=True), [70, EOS], None),
    (SamplingParams(max_tokens=8, stop_token_ids=[71]), [70, 71], "stop"),
    (SamplingParams(max_tokens=2), [70, 71], "length"),
    (SamplingParams(max_tokens=2), [70, EOS], "stop"),
    (SamplingParams(max_tokens=8, stop=["GH"]), [70, 71, 72], "stop"),  # "FGH": a stop string
]


@pytest.mark.parametrize(("sampling", "tokens", "expected"), CASES)
def test_a_dead_workers_stream_is_done_exactly_when_the_engine_would_have_stopped_it(sampling, tokens, expected):
    assert streamed(sampling, tokens).done_reason(sampling, EOS) == expected
    if not sampling.stop:  # stop strings are the detokenizer's; the engine rule sees tokens only
        request = Request("r", [5, 6, 7], sampling, 4, EOS)
        status = None
        for token in tokens:
            request.append_token_ids([token])
            status = request.check_stop_token(token)
        assert (status.value if status else None) == expected
        assert stop_status(sampling, tokens[-1], len(tokens), EOS) == (RequestStatus(expected) if expected else None)
