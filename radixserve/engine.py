"""The in-process Engine: scheduler + worker + tokenizer logic in one Python object.

    from radixserve import Engine, SamplingParams
    engine = Engine()                      # the embedded SmolLM2, prefix cache on
    [r] = engine.generate("Hello", SamplingParams(max_tokens=16, temperature=0))
    print(r.text, r.usage.cached_tokens)

It runs the same scheduler and worker code as the server, lockstep, with no
sockets: the quickest way to use radixserve from Python and the place where
correctness is tested (greedy tokens against HF transformers, cache on vs off,
chunked vs whole prefill, eviction and retraction).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve.compose import build_scheduler, build_worker
from radixserve.config import EngineConfig, tokenizer_config
from radixserve.program import EngineBackend, ProgramState
from radixserve.protocol import ImageInput, OutputItem
from radixserve.results import Result, TokenLogprobs, Usage
from radixserve.sampling_params import SamplingParams
from radixserve.tokenizer.explain import render_dashboard, render_explain
from radixserve.tokenizer.inputs import InputProcessor
from radixserve.tokenizer.output import OutputStream, TokenTexts

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


class Engine:
    def __init__(
        self,
        model: str | None = EngineConfig.model,
        *,
        lora: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        """``kwargs`` are ``EngineConfig``'s fields (``radixserve.config``). ``lora``:
        LoRA adapters to serve, name -> PEFT folder (``lora_modules`` as a mapping;
        docs/lora.md)."""
        from radixserve.models.source import resolve_model
        from radixserve.models.tokenizer import load_tokenizer
        from radixserve.tokenizer.images import load_vision_inputs

        if lora:
            modules = tuple(kwargs.pop("lora_modules", ()))
            kwargs["lora_modules"] = modules + tuple(f"{n}={p}" for n, p in lora.items())
        self.config = EngineConfig(model=model, **kwargs)
        self.tokenizer = load_tokenizer(model, self.config.cache_dir)
        self.runner = build_worker(self.config, self.tokenizer)
        self.scheduler = build_scheduler(self.config, self.runner.info())
        self.texts = TokenTexts(self.tokenizer)
        info = self.runner.info()
        source = resolve_model(model, self.config.cache_dir)
        vision = None if source.gguf_file else load_vision_inputs(source.folder, self.tokenizer)
        self.inputs = InputProcessor(
            self.tokenizer, info.vocab_size, tokenizer_config(self.config), info.max_context_len,
            vision,
        )  # fmt: skip
        self._ids = itertools.count()

    # ---------------------------------------------------------------- public
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora: str | Sequence[str | None] | None = None,
        images: Sequence[Any] | None = None,
    ) -> list[Result]:
        """Generate for one prompt or a list of them (text, token ids or chat
        messages). Returns the Results in prompt order (n per prompt when
        ``n > 1``). ``tools``: tool definitions (OpenAI's ``{type: function,
        function: {name, description, parameters}}``) the chat template renders into
        each prompt, which must then all be chats. ``lora``: the name of a loaded LoRA
        adapter to generate with (None: the base model), or one per prompt (they run
        in the same batches). ``images`` (vision-language models, docs/multimodal.md):
        the images of a text or token-id prompt, one per placeholder token in it (bytes,
        a path, a PIL image, a data URL); with a list of prompts, one such list (or
        None) per prompt. Chats carry their images in content parts (``{type: image,
        image}`` or ``{type: image_url, image_url: {url}}``). Bad input raises
        ValueError before anything runs."""
        prompt_list = _as_prompt_list(prompts)
        per_prompt: list[Any] = [None] * len(prompt_list)
        if images is not None:
            per_prompt = (
                [images] if len(prompt_list) == 1 and prompt_list[0] is prompts else list(images)
            )
            if len(per_prompt) != len(prompt_list):
                raise ValueError("give the images of one prompt, or one list per prompt")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError("give one SamplingParams, or one per prompt")
        requests = [self._to_request(p, tools, im) for p, im in zip(prompt_list, per_prompt)]
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise ValueError("give one LoRA adapter name (or None), or one per prompt")
        streams = self._add_requests(requests, params, cache_salt, loras)
        order = list(streams)
        results: dict[tuple[str, int], Result] = {}
        while self.scheduler.has_work():
            for out in self.scheduler.step(self.runner.step):
                if (result := self._postprocess(out, streams)) is not None:
                    results[(out.rid, out.index)] = result
        if len(results) != len(order):
            raise RuntimeError("the scheduler stopped with requests unfinished")
        return [results[key] for key in order]

    def program(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        cache_salt: str | None = None,
    ) -> ProgramState:
        """A prompt program (``radixserve.program``, docs/programs.md) starting from a
        text (tokenized with special tokens), token ids, or chat messages (rendered
        without a generation prompt); from nothing when none is given."""
        backend = EngineBackend(self, cache_salt)
        return ProgramState(backend, prompt, input_ids=input_ids, messages=messages)

    def stats(self) -> dict[str, int]:
        return self.scheduler.stats()

    def explain_cache(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> dict[str, Any]:
        """What the prefix cache would serve of ``prompt`` now (text, token ids or chat
        messages, as for ``generate``), and why no more, without running the model
        (docs/cache-tiers.md, "Explain"). ``cache_salt`` and ``lora`` pick the
        namespace."""
        ids = self._to_ids(prompt, tools)
        report = self.scheduler.explain(ids, cache_salt, lora)
        return render_explain(self._decode_kept, report)

    def dashboard(self) -> dict[str, Any]:
        """The dashboard's figures (docs/http.md, "Dashboard")."""
        return render_dashboard(self._decode_kept, self.scheduler.dashboard())

    def _decode_kept(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load the PEFT adapter folder ``path`` as ``name`` (ValueError saying why it
        cannot be served; the engine goes on without it). Returns its description
        (id, digest: its cache namespace, rank)."""
        tag = object()
        self.scheduler.loras.load(name, path, tag)
        while self.scheduler.loras.busy:
            self.scheduler.step(self.runner.step)
        replies = self.scheduler.lora_replies
        for i, (t, reply) in enumerate(replies):
            if t is tag:
                del replies[i]
                if "error" in reply:
                    raise ValueError(reply["error"])
                return reply
        raise RuntimeError("the worker did not report the LoRA load")

    def unload_lora(self, name: str) -> dict[str, Any]:
        """Stop serving ``name`` (ValueError if unknown); between ``generate`` calls no
        request uses it, so the worker drops it at the next step."""
        reply = self.scheduler.loras.unload(name)
        while self.scheduler.loras.busy:
            self.scheduler.step(self.runner.step)
        return reply

    def list_loras(self) -> list[dict[str, Any]]:
        """The adapters served: name, id, path, digest, rank each."""
        return self.scheduler.loras.listing()

    def flush_cache(self, keep_disk: bool = False) -> int:
        """Evict every unlocked cached page (and empty the cache tiers, the disk tier
        unless ``keep_disk``); returns how many pool pages were freed."""
        self._finish_copies()
        return self.scheduler.flush_cache(keep_disk)

    def check_idle(self) -> None:
        """Assert the idle invariant (every page free or owned by one tree node)."""
        self._finish_copies()
        self.scheduler.check_idle()

    def _finish_copies(self) -> None:
        """Step until no copy between cache tiers waits or is in flight (between
        ``generate`` calls there are none: it steps while any is)."""
        while self.scheduler.only_copies_pending:
            self.scheduler.step(self.runner.step)

    def close(self) -> None:
        """Release the worker (with ``tp > 1``: stop its other ranks' processes)."""
        if self.runner is not None and hasattr(self.runner, "close"):
            self.runner.close()
        self.runner = None  # type: ignore[assignment]
        self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- helpers
    def _to_request(
        self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None, images: Any = None
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids and images (this process's own: local paths are allowed)."""
        kw: dict[str, Any] = {"tools": tools, "images": images, "trusted": True}
        if isinstance(prompt, str):
            return self.inputs.to_request(prompt=prompt, **kw)
        if prompt and isinstance(prompt[0], Mapping):
            return self.inputs.to_request(messages=prompt, **kw)  # type: ignore[arg-type]
        return self.inputs.to_request(input_ids=prompt, **kw)  # type: ignore[arg-type]

    def _add_requests(
        self,
        requests: list[tuple[list[int], list[ImageInput]]],
        params: list[SamplingParams],
        salt: str | None,
        loras: Sequence[str | None] | None = None,
    ) -> dict[tuple[str, int], OutputStream]:
        """Queue every prompt (under its LoRA adapter, if any), checking them all
        first; a stream per sample."""
        loras = list(loras) if loras is not None else [None] * len(requests)
        for (ids, _), sp, lora in zip(requests, params, loras):
            self.inputs.check_sampling(sp)
            self.scheduler.check_request(ids, sp)
            if lora is not None:
                self.scheduler.loras.lookup(lora)
        streams: dict[tuple[str, int], OutputStream] = {}
        for (ids, images), sp, lora in zip(requests, params, loras):
            rid = f"engine-{next(self._ids)}"
            self.scheduler.add_request(rid, ids, sp, salt=salt, lora=lora, images=images)
            for i in range(sp.n):
                streams[(rid, i)] = OutputStream(self.tokenizer, ids, sp.stop, self.texts)
        return streams

    def _postprocess(
        self, out: OutputItem, streams: dict[tuple[str, int], OutputStream]
    ) -> Result | None:
        """Detokenize one output; the sample's Result once it has finished.

        A stop string ends the sample here and aborts it in the scheduler (whose
        own abort output then finds no stream and is ignored).
        """
        key = (out.rid, out.index)
        stream = streams.get(key)
        if stream is None:
            return None
        finish = out.finish_reason
        stream.add(out.token_ids, finish is not None, out.logprobs, out.prompt_logprobs)
        if stream.stop_hit and finish is None:
            self.scheduler.abort_request(out.rid, reason="stop", index=out.index)
            finish = "stop"
        if finish is None:
            return None
        del streams[key]
        return Result(
            request_id=out.rid,
            index=out.index,
            text=stream.text,
            token_ids=list(stream.token_ids),
            finish_reason=finish,
            usage=Usage(
                out.prompt_tokens,
                len(stream.token_ids),
                out.cached_tokens,
                list(out.cached_tokens_by_tier),
                out.retained_tokens,
                None if out.explain is None else render_explain(self._decode_kept, out.explain),
            ),
            logprobs=TokenLogprobs.list_from_wire(stream.logprobs),
            prompt_logprobs=TokenLogprobs.list_from_wire(stream.prompt_logprobs),
            error=out.error,
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a prompt or a non-empty list of prompts")
    first = prompts[0]
    if isinstance(first, (int, Mapping)):
        return [prompts]  # one token list, or one chat
    return list(prompts)
