"""The tokenizer endpoints vLLM and SGLang serve, in vLLM's shapes: ``POST /tokenize`` (a text,
or chat messages through the model's chat template), ``POST /detokenize`` and
``GET /tokenizer_info``. Evaluation harnesses (lm-evaluation-harness's ``local-completions``)
read ``/tokenizer_info`` first and then tokenize through the server, so the ids they score are
the ids the server runs.

``/tokenizer_info`` is the tokenizer's configuration as ``tokenizer_config.json`` holds it:
``tokenizer_class``, the special tokens' strings (``bos_token``, ``eos_token``, ``pad_token``,
``unk_token``; null where the tokenizer has none), ``chat_template`` (the one the server renders
with: the checkpoint's, kvfleet's own for the byte vocabulary, null where there is none and chat
requests are refused), ``clean_up_tokenization_spaces``, and
``model_max_length`` (the served context, not the tokenizer's unbounded default) and
``vocab_size`` (the model's). File paths and the added-token table are left out.
"""

from __future__ import annotations

from typing import Any

from cluster.api import Cluster
from cluster.served_model import ServedModel
from engine.chat_templates import BYTE_CHAT_TEMPLATE
from engine.tokenizer import ByteTokenizer, HFTokenizer
from engine.validation import in_vocabulary
from serving.errors import bad_request, model_not_found
from serving.logprob_format import TokenStrings
from serving.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from serving.tools import ToolCalling

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenization:
    """Answers the tokenizer endpoints for one served model; owns the token strings of
    ``return_token_strs`` (each id's vocabulary piece, as ``convert_ids_to_tokens`` names it; a
    byte vocabulary has none, so its ids are named as logprobs name them)."""

    def __init__(self, cluster: Cluster, model_name: str):
        self.cluster = cluster
        self.model_name = model_name
        self._strings: TokenStrings | None = None  # built on first use: the model is known once serving

    @property
    def model(self) -> ServedModel:
        return self.cluster.model

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
        self._check_model(body.model)
        tokenizer = self.model.tokenizer
        if isinstance(body, TokenizeCompletionRequest):
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            calling = ToolCalling.of(body.tools, None, True)
            messages = [m.for_template() for m in body.messages]
            try:
                ids = tokenizer.chat_token_ids(
                    messages, body.add_generation_prompt, calling.template_tools() if calling else None
                )
            except ValueError as exc:
                raise bad_request("messages", str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - the template refused the conversation (jinja's TemplateError)
                raise bad_request("messages", f"messages: the chat template refused them ({exc})") from None
        return {
            "count": len(ids),
            "max_model_len": self.model.max_model_len,
            "tokens": ids,
            "token_strs": self._token_strs(ids) if body.return_token_strs else None,
        }

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        vocab = self.model.vocab_size
        bad = next((t for t in body.tokens if not in_vocabulary(t, vocab)), None)
        if bad is not None:
            raise bad_request("tokens", f"tokens: token id {bad} is outside the vocabulary [0, {vocab})")
        return {"prompt": self.model.tokenizer.decode(list(body.tokens))}

    def info(self) -> dict[str, Any]:
        tokenizer = self.model.tokenizer
        if isinstance(tokenizer, HFTokenizer):
            hf = tokenizer.backend
            info: dict[str, Any] = {"tokenizer_class": type(hf).__name__}
            for name in SPECIAL_TOKEN_NAMES:
                value = getattr(hf, name, None)
                info[name] = str(value) if value is not None else None
            template = getattr(hf, "chat_template", None)
            info["chat_template"] = template if isinstance(template, str) else None
            info["clean_up_tokenization_spaces"] = bool(getattr(hf, "clean_up_tokenization_spaces", False))
        else:
            eos = self.model.eos_token_id
            info = {"tokenizer_class": type(tokenizer).__name__, **dict.fromkeys(SPECIAL_TOKEN_NAMES)}
            if isinstance(tokenizer, ByteTokenizer) and eos is not None and 0 <= eos < 0x80:
                info["eos_token"] = chr(eos)  # a byte vocabulary's end token is that byte
            info["chat_template"] = BYTE_CHAT_TEMPLATE if isinstance(tokenizer, ByteTokenizer) else None
            info["clean_up_tokenization_spaces"] = False
        info["model_max_length"] = self.model.max_model_len
        info["vocab_size"] = self.model.vocab_size
        return info

    def _token_strs(self, ids: list[int]) -> list[str]:
        tokenizer = self.model.tokenizer
        if isinstance(tokenizer, HFTokenizer):
            pieces = tokenizer.backend.convert_ids_to_tokens(ids)
            return [str(p) for p in pieces]
        if self._strings is None:
            self._strings = TokenStrings(tokenizer)
        return [self._strings.text(t) for t in ids]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)
