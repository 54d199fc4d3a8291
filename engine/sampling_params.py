"""Per-request sampling and stopping parameters: a frozen pydantic model, strictly validated on
construction, so that nothing a worker cannot sample with ever reaches one.

Strict means: a string where a number belongs, a float or a bool where an integer belongs, NaN
and infinities are refused, as are unknown keywords and out-of-range values. A failure raises
``InvalidRequestError`` (a ``ValueError``) with one line per bad field, e.g.
``temperature: must be a finite number (got nan)``. ``stop`` and ``stop_token_ids`` take a list
or a tuple (``stop`` also one string) and are stored as tuples, so the model stays hashable.
Equality and hashing ignore ``extra``, as the dataclass this replaces did.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.validation import InvalidRequestError, describe_validation_error, problem, short_repr

#: the smallest non-zero temperature: smaller ones are greedy in effect, and far smaller ones
#: (1e-38) overflow the scaled float32 logits, which gives the sampler NaN probabilities
MIN_TEMPERATURE = 1e-3
#: seeds a torch.Generator takes: signed or unsigned 64-bit
SEED_MIN, SEED_END = -(2**63), 2**64

#: the most top logprobs a request may ask for per position (OpenAI's limit)
MAX_TOP_LOGPROBS = 20

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]


class StructuredOutput(BaseModel):
    """A constraint on what a request may generate, applied as a token mask while sampling.

    ``kind`` says what ``spec`` is: ``json_object`` (any JSON object; ``spec`` empty),
    ``json_schema`` (a JSON Schema, as JSON text), ``regex`` (a regular expression the whole
    output matches), ``grammar`` (an EBNF grammar) or ``choice`` (a JSON list of strings, the
    output is one of them)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    kind: Literal["json_object", "json_schema", "regex", "grammar", "choice"]
    spec: str = ""


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters;
    ``seed`` makes a sampled request reproducible on its own, independent of batching.
    Build a changed copy with ``replace(...)`` (validated; ``model_copy(update=...)`` is not).
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    max_tokens: Annotated[int, Field(ge=1)] = 16
    temperature: Annotated[FiniteFloat, Field(ge=0.0)] = 0.0
    top_k: Annotated[int, Field(ge=0)] = 0
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    stop_token_ids: tuple[TokenId, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    #: logprobs per output token: None none, k >= 0 the sampled token's and the k most likely
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    #: logprobs per prompt token (``echo``): None none, k >= 0 as ``logprobs``
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    #: OpenAI's penalties on the output so far: presence subtracts once per token that occurred,
    #: frequency once per occurrence; repetition (vLLM's, > 1 penalises) divides a positive logit
    #: (multiplies a negative one) of every token in the prompt or the output
    presence_penalty: Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[FiniteFloat, Field(gt=0.0, le=10.0)] = 1.0
    #: added to a token's logit before sampling, as ``(token_id, bias)`` pairs (a dict is taken)
    logit_bias: tuple[tuple[TokenId, Annotated[FiniteFloat, Field(ge=-100.0, le=100.0)]], ...] = ()
    #: drop tokens whose probability is below ``min_p`` times the most likely one's
    min_p: Annotated[FiniteFloat, Field(ge=0.0, le=1.0)] = 0.0
    structured: StructuredOutput | None = None
    extra: dict[str, object] = Field(default_factory=dict)

    def __init__(self, **fields: Any) -> None:
        try:
            super().__init__(**fields)
        except ValidationError as exc:
            raise InvalidRequestError(describe_validation_error(exc)) from None

    @field_validator("temperature")
    @classmethod
    def _not_vanishing(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (got {temperature!r})")
        return temperature

    @field_validator("seed")
    @classmethod
    def _fits_64_bits(cls, seed: int | None) -> int | None:
        if seed is not None and not SEED_MIN <= seed < SEED_END:
            raise ValueError(f"must fit in 64 bits (got {seed!r})")
        return seed

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: object) -> object:
        strings = (stop,) if isinstance(stop, str) else stop
        if not isinstance(strings, (list, tuple)):
            raise ValueError(f"must be a string or a list of strings (got {short_repr(stop)})")  # noqa: TRY004 - pydantic reports only ValueError as a field error
        if any(isinstance(s, str) and not s for s in strings):
            raise ValueError(f"stop strings must be non-empty (got {short_repr(stop)})")
        return tuple(strings)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _listed_ids(cls, ids: object) -> object:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"must be a list of token ids (got {short_repr(ids)})")  # noqa: TRY004 - pydantic reports only ValueError as a field error
        return tuple(ids)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, bias: object) -> object:
        if isinstance(bias, dict):
            pairs = []
            for key, value in bias.items():
                token = int(key) if isinstance(key, str) and key.isdigit() else key
                pairs.append((token, float(value) if isinstance(value, int) and not isinstance(value, bool) else value))
            return tuple(sorted(pairs, key=lambda pair: (str(type(pair[0])), pair[0])))
        if isinstance(bias, (list, tuple)):
            return tuple(tuple(pair) if isinstance(pair, list) else pair for pair in bias)
        raise ValueError(f"must map token ids to biases (got {short_repr(bias)})")

    def model_post_init(self, context: object, /) -> None:
        # the flags the sampler reads for every row of every step, computed once (a frozen model:
        # they never change; ``replace`` builds a new instance)
        for flag in ("penalises", "changes_logits", "plain_greedy", "launchable"):
            getattr(self, flag)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def penalises(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @cached_property
    def changes_logits(self) -> bool:
        """Whether a penalty, a bias or a structured-output mask applies to the row's logits."""
        return self.penalises or bool(self.logit_bias) or self.structured is not None

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits and no logprobs: the argmax of the raw logits."""
        return self.temperature == 0.0 and self.logprobs is None and not self.changes_logits

    @cached_property
    def launchable(self) -> bool:
        """Whether a row can be sampled in a step whose input token the host does not know yet
        (``Scheduler.schedule_continuation``): nothing reads the output history (penalties) or is
        reported beside the token (logprobs), and no host-built mask applies."""
        return not self.changes_logits and self.logprobs is None and self.prompt_logprobs is None

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied, validated like a new instance."""
        return SamplingParams(**{**self._fields(), **changes})

    @classmethod
    def coerce(cls, value: object, field: str = "sampling") -> SamplingParams:
        """``value`` as SamplingParams: None gives the defaults, a mapping its fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict) and all(isinstance(key, str) for key in value):
            return cls(**value)
        raise InvalidRequestError(problem(field, "must be SamplingParams or a dict of its fields", value))

    def __str__(self) -> str:
        return repr(self)

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in type(self).model_fields}

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in type(self).model_fields if name != "extra")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())
