"""Request bodies of SGLang's native API (``/generate``, ``/abort_request``) and of the
tokenizer routes SGLang and vLLM share (``/tokenize``, ``/detokenize``), and what a
``/generate`` body becomes: one ``Plan`` (prompt, sampling parameters, request id) per
prompt.

Field names and meanings are SGLang's (``GenerateReqInput`` and its sampling
parameters); a field left out or ``null`` takes SGLang's default. As on the OpenAI
routes, types are strict and unknown fields are refused with a 400 naming them. Fields
SGLang defines that radixserve cannot honour are declared only to refuse them with a
message (``unsupported``): a request never silently gets a different completion.
docs/http.md lists every field.

One leniency, for gateways that re-serialize SGLang's whole ``GenerateReqInput``
(SGLang's model gateway, ``sglang-router``, sends every field it knows, most at their
defaults): on ``/generate`` an unknown top-level field whose value asks for nothing
(null, false, an empty string, list or map) is dropped; with any other value it is
refused as before. ``model`` is taken and must then be a served name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import Field, StrictBool, StrictStr, model_validator

from radixserve.http.openai_schema import (
    ChatMessage,
    Int,
    Number,
    Schema,
    TokenIds,
    _Strict,
)
from radixserve.protocol import MAX_ID_LEN
from radixserve.sampling_params import SamplingParams, StructuredOutput

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default for max_new_tokens
T = TypeVar("T")


class SGLangSampling(_Strict):
    """SGLang's ``sampling_params``. ``max_new_tokens: null`` generates until EOS or the
    end of the context; ``json_schema`` is the schema's JSON text (an object is taken
    too)."""

    max_new_tokens: Int | None = SGLANG_MAX_NEW_TOKENS
    min_new_tokens: Int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int | None = None
    min_p: Number | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    repetition_penalty: Number | None = None
    n: Int | None = None
    json_schema: StrictStr | Schema | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    ignore_eos: StrictBool | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    sampling_seed: Int | None = None
    # Accepted at SGLang's defaults only: radixserve's output text always skips special
    # tokens, joins them without spaces, and ends before a matched stop string.
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    # Declared to be refused (unsupported below); SGLang's frontend always sends an
    # empty stop_regex list, which means none.
    stop_regex: StrictStr | list[StrictStr] | None = None
    structural_tag: StrictStr | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: Int | None = None

    def unsupported(self) -> str | None:
        if self.stop_regex:
            return "sampling_params.stop_regex is not supported"
        for name in ("structural_tag", "custom_params", "stream_interval"):
            if getattr(self, name) is not None:
                return f"sampling_params.{name} is not supported"
        if self.skip_special_tokens is False:
            return "sampling_params.skip_special_tokens=false is not supported"
        if self.spaces_between_special_tokens is False:
            return "sampling_params.spaces_between_special_tokens=false is not supported"
        if self.no_stop_trim:
            return "sampling_params.no_stop_trim=true is not supported"
        return None

    def structured(self) -> StructuredOutput | None:
        found = []
        if self.json_schema is not None:
            found.append(StructuredOutput.json(self.json_schema))
        if self.regex is not None:
            found.append(StructuredOutput.regex(self.regex))
        if self.ebnf is not None:
            found.append(StructuredOutput.grammar(self.ebnf))
        if len(found) > 1:
            raise ValueError("sampling_params: give at most one of json_schema, regex, ebnf")
        return found[0] if found else None

    def sampling(
        self, context_len: int, logprobs: dict[str, int], priority: int | None = None
    ) -> SamplingParams:
        """radixserve's SamplingParams (ValueError names a bad value)."""
        fields: dict[str, Any] = {
            "max_tokens": context_len if self.max_new_tokens is None else self.max_new_tokens
        }
        renamed = {"min_new_tokens": "min_tokens", "sampling_seed": "seed"}
        for name in (
            "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
            "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "n",
            "ignore_eos", "logit_bias", "sampling_seed",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                fields[renamed.get(name, name)] = value
        if fields["max_tokens"] == 0:  # a prefill (SGLang's prefix caching, select's scoring)
            logprobs = {k: v for k, v in logprobs.items() if k != "logprobs"}
        if priority is not None:
            fields["priority"] = priority
        return SamplingParams(**fields, **logprobs, structured=self.structured())


@dataclass(frozen=True)
class Plan:
    """One prompt of a ``/generate`` request, ready for a ``Generation``."""

    prompt: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    rid: str | None  # None: the front draws one
    cache_salt: str | None
    logprob_start_len: int  # -1: no prompt logprobs
    top_logprobs_num: int
    return_logprob: bool
    images: list[str] | None = None  # image_data: one per image placeholder of the prompt


class GenerateRequest(_Strict):
    """SGLang's ``POST /generate``: ``text`` or ``input_ids``, one prompt or a batch.
    Per-prompt fields (``sampling_params``, ``rid``, the logprob fields, ``cache_salt``)
    take one value for every prompt or a list with one per prompt."""

    text: StrictStr | list[StrictStr] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    # Images (vision-language models): URLs (data:image/...;base64, or allowed file:// and
    # http(s)://), one per image placeholder; a list of them per prompt for a batch.
    image_data: StrictStr | list[StrictStr] | list[list[StrictStr]] | None = None
    sampling_params: SGLangSampling | list[SGLangSampling] | None = None
    rid: StrictStr | list[StrictStr] | None = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: Int | list[Int] | None = None
    top_logprobs_num: Int | list[Int] | None = None
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    cache_salt: StrictStr | list[StrictStr] | None = None
    priority: Int | list[Int] | None = None  # lower first (docs/scheduler.md, "Priorities")
    model: StrictStr | None = None  # a gateway's: the served name it routed by
    log_metrics: StrictBool = True  # radixserve's metrics count every request either way

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_extras(cls, data: Any) -> Any:
        """Unknown fields that ask for nothing are dropped (module docstring)."""
        if not isinstance(data, dict):
            return data
        known = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if k in known or not (v is None or v is False or v in ("", [], {}))
        }

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        ids = self.input_ids
        return bool(ids) and isinstance(ids[0], list)  # type: ignore[index]

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        given = self.text if self.text is not None else self.input_ids
        prompts = list(given) if self.is_batch else [given]  # type: ignore[arg-type]
        if not prompts:
            raise ValueError("the batch is empty")
        return prompts  # type: ignore[return-value]

    def plans(self, context_len: int) -> list[Plan]:
        """One plan per prompt (ValueError names a bad field)."""
        prompts = self.prompts()
        k = len(prompts)
        sampling = _each(self.sampling_params, k, "sampling_params")
        rids = self._rids(k)
        want = _each(self.return_logprob, k, "return_logprob")
        starts = _each(self.logprob_start_len, k, "logprob_start_len")
        tops = _each(self.top_logprobs_num, k, "top_logprobs_num")
        salts = _each(self.cache_salt, k, "cache_salt")
        priorities = _each(self.priority, k, "priority")
        images = self._images(k)
        plans = []
        for p, prompt in enumerate(prompts):
            sp = sampling[p] or SGLangSampling()
            why = sp.unsupported()
            if why is not None:
                raise ValueError(why)
            start = -1 if starts[p] is None else starts[p]
            top = 0 if tops[p] is None else tops[p]
            logprobs: dict[str, int] = {}
            if want[p]:
                logprobs["logprobs"] = top
                if start >= 0:
                    logprobs.update(prompt_logprobs=top, logprob_start_len=start)
            elif start != -1 or top:
                raise ValueError("logprob_start_len and top_logprobs_num need return_logprob")
            text = prompt if isinstance(prompt, str) else None
            ids = None if isinstance(prompt, str) else prompt
            plans.append(
                Plan(
                    text,
                    ids,
                    sp.sampling(context_len, logprobs, priorities[p]),
                    rids[p],
                    salts[p],
                    start,
                    top,
                    bool(want[p]),
                    images[p],
                )  # fmt: skip
            )
        return plans

    def _images(self, k: int) -> list[list[str] | None]:
        """``image_data`` per prompt: one URL or a list of them for one prompt; a list of
        lists (or of URLs, one each) for a batch."""
        data = self.image_data
        if data is None:
            return [None] * k
        if not self.is_batch:
            return [[data] if isinstance(data, str) else list(data)]  # type: ignore[list-item]
        if len(data) != k:
            raise ValueError(f"image_data has {len(data)} entries for {k} prompts")
        return [[d] if isinstance(d, str) else list(d) for d in data]

    def _rids(self, k: int) -> list[str | None]:
        if isinstance(self.rid, str) and self.is_batch:
            rids: list[str | None] = [f"{self.rid}_{p}" for p in range(k)]  # SGLang's per item
        else:
            rids = _each(self.rid, k, "rid")
        if any(r is not None and not 0 < len(r) <= MAX_ID_LEN for r in rids):
            raise ValueError(f"rid must be a non-empty string of at most {MAX_ID_LEN} characters")
        return rids


def _each(value: T | list[T] | None, k: int, name: str) -> list[T | None]:
    """A per-prompt field as one value per prompt."""
    if isinstance(value, list):
        if len(value) != k:
            raise ValueError(f"{name} has {len(value)} entries for {k} prompts")
        return list(value)
    return [value] * k


class AbortRequest(_Strict):
    """SGLang's ``POST /abort_request``: one request by its ``rid``, or every ``/generate``
    request in flight with ``abort_all``."""

    rid: Annotated[StrictStr, Field(max_length=MAX_ID_LEN)] = ""
    abort_all: StrictBool = False


class TokenizeRequest(_Strict):
    """``POST /tokenize``, SGLang's and vLLM's: a text (or, SGLang, a list of texts) or,
    vLLM, chat ``messages``."""

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictStr] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vLLM's defaults: true around a text, false after a chat template (which has its own)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    def unsupported(self) -> str | None:
        if (self.prompt is None) == (self.messages is None):
            return "give exactly one of prompt or messages"
        if self.messages is not None and self.add_special_tokens:
            return "add_special_tokens=true is not supported with messages"
        if self.return_token_strs:
            return "return_token_strs is not supported"
        return None


class DetokenizeRequest(_Strict):
    """``POST /detokenize``, SGLang's and vLLM's: token ids (or, SGLang, a list of them)."""

    model: StrictStr | None = None
    tokens: TokenIds | list[TokenIds]
    skip_special_tokens: StrictBool = True  # SGLang's default; vLLM's decode keeps them
