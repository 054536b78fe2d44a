"""The engine: one loaded model, its sessions, the KV store their caches share, and the scheduler that
runs every generation of the model together."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import math
import threading
from collections import OrderedDict
from numbers import Integral, Real
from pathlib import Path

import torch
from transformers import GenerationConfig

import processors as proc
from processors.structured import Vocabulary
from processors.structured.constraints import Compiled, Constraint
from protocol.schema import DEFAULT_NUM_BEAMS

from . import attention, chat, fidelity, generation_defaults, inputs, models, persist, shift
from .errors import (
    ContextOverflow,
    InvalidArgument,
    InvalidModel,
    InvalidProcessor,
    UnknownStrategy,
    refusal_of,
)
from .kv import KVStore
from .scheduler import Scheduler
from .text import check_unicode
from .session import REUSES, STRATEGIES, Request, Session

log = logging.getLogger("sidecar")

DEFAULT_CACHE_BUDGET = 2 * 1024**3
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_MAX_ROWS = 64
MAX_LOGPROBS = 20  # the most likely tokens a step reports besides its own (OpenAI's top_logprobs, vLLM's default)


class Engine:
    """A causal LM with its tokenizer and sessions.

    `cache_budget_bytes` bounds the KV memory of all sessions and generations together, at every moment:
    a generation reserves what it needs to its end before it starts, evicting the caches of the least
    recently used idle sessions first (their token history stays, and their next call recomputes).
    `prefill_chunk` is the number of prompt tokens one forward pass takes, besides one token per
    decoding row. With `share_prefixes` (the default) a session continues a prefix that another
    session's cache holds instead of computing it again (`sidecar.sharing`); without it each session
    reuses only its own cache, and a fork copies.

    The model's attention is switched to `sidecar.attention` (still plain SDPA when called directly).

    Sessions may be used from several threads (a threaded web server's): every change to the engine's
    state (a step, a call starting, a session opened, closed, forked, saved or restored) holds `lock`,
    so the threads take turns step by step, and each step serves the generations of every thread. A
    step holds it while processors run: a processor that waits for another thread's use of an engine
    (this one, or another engine whose own step waits for this one) waits for ever.
    """

    def __init__(self, model, tokenizer, *, path: Path | None = None,
                 cache_budget_bytes: int = DEFAULT_CACHE_BUDGET, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_rows: int = DEFAULT_MAX_ROWS, share_prefixes: bool = True):
        _check_options(cache_budget_bytes=cache_budget_bytes, prefill_chunk=prefill_chunk, max_rows=max_rows,
                       share_prefixes=share_prefixes)
        eos = model.generation_config.eos_token_id
        if not all(_is_int(e) and e >= 0 for e in generation_defaults.end_tokens(eos)):
            raise InvalidModel(f"the model's generation config has eos_token_id {str(eos)[:100]}, which is not a token "
                               "id or a list of them", **({"path": str(path)} if path is not None else {}))
        training, self.model = model.training, model.eval()  # dropout off, as from_pretrained leaves it (or it drew at random)
        self.tokenizer = tokenizer
        # transformers warns once per tokenizer of a text tokenized past the model's context, "Running this
        # sequence through the model will result in indexing errors": the engine runs none (context_overflow
        # refuses it first) and tokenize only counts, so it is marked as given, by transformers' own switch
        getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
        self.path = path
        self.cache_budget_bytes = int(cache_budget_bytes)
        self.prefill_chunk = int(prefill_chunk)
        self.max_rows = int(max_rows)  # num_beams and num_samples at most
        self.share_prefixes = share_prefixes
        self.vocab_size = models.vocab_size(model)
        self._default_eos = _default_eos(model, tokenizer, self.vocab_size)
        self.generation_defaults = generation_defaults.of(model.generation_config, self.vocab_size)
        # the bytes each token id writes: what constraints are compiled against, and what tells a generation's
        # text (`text.detokenizer`). Made here, on a loading thread for a
        # load_model (0.1 s at 32k tokens), not by a request on the server's main thread.
        self.vocabulary = Vocabulary.from_tokenizer(tokenizer, self.vocab_size)
        self.max_context = models.max_context(model.config)
        self._sessions: OrderedDict[int, Session] = OrderedDict()  # least recently used first
        self._ids = itertools.count(1)
        self.lock = threading.RLock()
        self.store = KVStore(self.cache_budget_bytes, model.device, model.dtype)
        previous = model.config._attn_implementation
        attention.install(model)
        try:
            self._probe()
            fidelity.check(model, self.store, self.windows)
        except InvalidModel:  # a model refused is given back as it came: its own calls stay transformers'
            model.set_attn_implementation(previous)
            model.train(training)
            raise
        self.scheduler = Scheduler(self)

    def _probe(self) -> None:
        """One throw-away forward pass that tells the store each layer's key/value shape, and this engine each
        layer's sliding window (`windows`); refuses a model whose attention this engine's would not reproduce."""
        probe = attention.Probe(self.store)
        try:
            with torch.inference_mode(), attention.planned(probe):
                one = torch.zeros(1, 1, dtype=torch.long, device=self.model.device)  # masked: id 0 may be its padding
                self.model(input_ids=one, attention_mask=torch.ones_like(one), use_cache=False)
        except Exception as error:  # a model whose own code fails on one token (an inconsistent config, say)
            raise fidelity.failed(self.model, error) from error
        if probe.unplaced:  # Inkling2's block-attention residual: refused for it, not for a failure it leads to
            raise InvalidModel(f"{type(self.model).__name__} calls attention outside its layers "
                               f"({', '.join(sorted(probe.unplaced))}, with no layer index), which the batched "
                               "engine cannot give a cache: its tokens would not be transformers'")
        if not self.store.layers or None in self.store.layers:
            raise InvalidModel(f"{type(self.model).__name__}'s attention does not go through transformers' "
                               "attention interface, which the batched engine needs")
        told = [probe.windows[i] for i in range(len(self.store.layers))]
        self.windows = attention.layer_windows(self.model.config, told)
        if self.windows != tuple(told) and not fidelity.reads_config_window(self.model):  # a window it never applies
            self.windows = attention.layer_windows(self.model.config, told, masked=False)
        for window in self.windows:  # 0 attends nothing (transformers' own masks fail on it)
            if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
                raise InvalidModel(f"{type(self.model).__name__}'s sliding window {window!r} is not a number of "
                                   "tokens >= 1")
        kinds = {kind for kind in getattr(self.model.config, "layer_types", None) or ()
                 if kind.endswith("_attention") and kind not in ("full_attention", "sliding_attention")}
        if kinds:  # their masks (chunks, sparse indices) are made by transformers, and not read by ours
            raise InvalidModel(f"{type(self.model).__name__} has layers of {', '.join(sorted(kinds))}, which the batched "
                               "engine's attention does not run: its tokens would not be transformers'")
        if probe.unrun:
            raise InvalidModel(f"{type(self.model).__name__}'s attention takes {', '.join(sorted(probe.unrun))}, which "
                               "the batched engine's attention does not run: its tokens would not be transformers'")

    @classmethod
    def load(cls, path=None, *, dtype=None, device: str = "cpu", trust_remote_code: bool = False, **options) -> "Engine":
        """Loads a local Hugging Face directory; with no path, the embedded default model (random weights)."""
        accepted = [name for name in inspect.signature(cls).parameters if name not in ("model", "tokenizer", "path")]
        for name in options:  # checked before the model loads, and so are their values
            if name not in accepted:
                raise InvalidArgument(f"Engine.load has no option {name!r}; valid: dtype, device, trust_remote_code, "
                                      f"{', '.join(accepted)}", option=name)
        _check_options(**options)
        model, tokenizer, resolved = models.load(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return cls(model, tokenizer, path=resolved, **options)

    def session(self) -> Session:
        with self.lock:
            session = Session(self, next(self._ids))
            self._sessions[session.id] = session
            return session

    @property
    def sessions(self) -> list[Session]:
        """The open sessions, least recently used first."""
        with self.lock:
            return list(self._sessions.values())

    @property
    def default_eos_token_ids(self) -> frozenset[int]:
        return self._default_eos

    def stats(self) -> dict:
        with self.lock:
            sessions = self.sessions
            shared = self.store.shared
            return {
                "sessions": len(sessions),
                "cached_sessions": sum(s.cached > 0 for s in sessions),
                "cached_tokens": sum(s.cached for s in sessions),
                "shared_prefixes": len(shared),
                "shared_bytes": sum(entry.nbytes for entry in shared),
                "cache_bytes": self.store.used_bytes,
                "cache_peak_bytes": self.store.peak_bytes,
                "cache_budget_bytes": self.cache_budget_bytes,
                "evictions": self.store.evictions,
            }

    @property
    def chat_templates(self) -> list[str]:
        """The names of the chat templates the model's tokenizer ships ([] for none)."""
        return chat.template_names(self.tokenizer)

    def validate(self, prompt=None, *, token_ids=None, messages=None, chat_template=None, add_generation_prompt=None,
                 continue_final_message=False, tools=None, documents=None, chat_template_kwargs=None, max_new_tokens=None, strategy=None, seed=None,
                 processors=None, stop=None, eos_token_ids=None, generation_config=None, num_samples=1, num_beams=None,
                 num_return_sequences=None, length_penalty=None, early_stopping=None, logprobs=None, prompt_logprobs=None,
                 reuse="prefix", keep=None, **unknown) -> Request:
        """Checks a generate call completely, before anything changes; returns it in normal form. `strategy`,
        `max_new_tokens`, `processors` and `stop` left out (None) are the model's (`generation_defaults`), with
        the fields `generation_config` changes (`defaults_for`)."""
        if unknown:
            name = next(iter(unknown))
            field = name in generation_defaults.CALL_FIELDS  # as transformers' generate(temperature=0.7) takes it
            raise InvalidArgument(f"generate has no option {name!r}" + (
                f": a field of the model's generation config is changed by generation_config={{{name!r}: ...}}" if field
                else f"; valid: {', '.join(generate_options())}"), option=name)
        _check_logprobs("logprobs", logprobs, "generated")
        _check_logprobs("prompt_logprobs", prompt_logprobs, "prompt")
        if isinstance(generation_config, GenerationConfig):  # the fields it sets, as transformers' generate reads it
            generation_config = generation_defaults.changes_of(generation_config, self.model.generation_config)
        defaults = self.defaults_for(generation_config, processors_given=processors is not None, strategy=strategy)
        input_ids = inputs.input_ids(self.tokenizer, self.vocab_size, prompt, token_ids=token_ids, messages=messages,
                                     chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message, tools=tools, documents=documents,
                                     chat_template_kwargs=chat_template_kwargs)
        if max_new_tokens is None:  # the model's, within what its context leaves (vLLM's default max_tokens)
            max_new_tokens = defaults.max_new_tokens
            if self.max_context is not None and "max_new_tokens" not in (generation_config or {}):  # the call's is its own
                max_new_tokens = min(max_new_tokens, max(0, self.max_context - len(input_ids)))
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}", option="max_new_tokens")
        if self.max_context is not None and len(input_ids) + max_new_tokens > self.max_context:
            raise ContextOverflow(
                f"{len(input_ids)} input tokens + max_new_tokens {max_new_tokens} exceed the model's context "
                f"of {self.max_context} tokens (max_context: its max_position_embeddings, or YaRN's extension of it)",
                limit="max_context", max=self.max_context, value=len(input_ids) + max_new_tokens,
            )
        if strategy is None:
            strategy = defaults.strategy
        if strategy not in STRATEGIES:
            raise UnknownStrategy(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**64):
            raise InvalidArgument(f"seed must be an integer in [0, 2^64), got {seed!r}", option="seed")
        if stop is None:  # the model's stop strings, which beams would refuse (they are scored to their end)
            stop = defaults.stop if strategy != "beam" else ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgument("stop must be a list of non-empty strings", option="stop")
        for i, text in enumerate(stop):
            check_unicode(text, "stop", f"stop[{i}]", index=i)
        if eos_token_ids is None:
            eos = self.default_eos_token_ids
        else:
            if hasattr(eos_token_ids, "tolist") and getattr(eos_token_ids, "ndim", None) == 0:  # as an int is taken
                eos_token_ids = eos_token_ids.reshape(1)
            eos_token_ids = inputs.vector_as_list(eos_token_ids, "eos_token_ids")
            if _is_int(eos_token_ids):
                eos_token_ids = [eos_token_ids]
            if not isinstance(eos_token_ids, (list, tuple)) or not all(_is_int(t) for t in eos_token_ids):
                raise InvalidArgument("eos_token_ids must be a token id or a list of them", option="eos_token_ids")
            self.check_token_ids(eos_token_ids, "eos_token_ids")
            eos = frozenset(int(t) for t in eos_token_ids)
        if processors is None:
            processors = defaults.processors_for(strategy, eos, len(input_ids))  # eos checked above
        if not isinstance(processors, (list, tuple, proc.Chain)):
            raise InvalidProcessor(f"processors must be a list of processors, got {type(processors).__name__}")
        try:
            chain = processors if isinstance(processors, proc.Chain) else proc.Chain(processors)
        except proc.ProcessorError as error:
            raise refusal_of(error) from error
        # a processor is named by its place in the chain as given (`Chain.indices`: a chain bound already keeps it)
        if chain.max_token_id >= self.vocab_size:
            position = next(i for i, p in enumerate(chain.processors) if p.max_token_id() >= self.vocab_size)
            processor, index = chain.processors[position], chain.indices[position]
            token_id = processor.max_token_id()
            raise InvalidProcessor(f"processors[{index}] ({processor.name}): {_naming(processor, token_id)}names token id "
                                   f"{token_id}, outside the vocabulary of {self.vocab_size}", index=index)
        position = next((i for i, p in enumerate(chain.processors) if isinstance(p, Constraint)), None)
        if position is not None and len(self.tokenizer) > self.vocab_size:
            # llguidance takes no vocabulary smaller than the tokenizer, our automata none wider than the logits
            index = chain.indices[position]
            raise InvalidProcessor(f"processors[{index}] ({chain.processors[position].name}): the tokenizer has "
                                   f"{len(self.tokenizer)} tokens, more than the model's {self.vocab_size} logits: "
                                   "a constraint needs the two to agree", index=index)
        try:  # constraints compile against the vocabulary (cached per constraint) and move to the front
            chain = chain.bind(self.vocabulary, eos, self.model.device)
        except proc.ProcessorError as error:
            raise refusal_of(error) from error
        rows = self._check_rows(strategy, stop, num_samples, num_beams, num_return_sequences, length_penalty, early_stopping)
        if rows.get("num_beams") == 1:  # one beam is greedy search, as in transformers
            strategy, rows = "greedy", {}
        shift_keep = self._check_reuse(reuse, keep)
        if shift_keep is not None and prompt_logprobs is not None:
            raise InvalidArgument("prompt_logprobs does not go with reuse 'shift': it computes the whole prompt anew, "
                                  "where a shift keeps part of it cached", option="prompt_logprobs")
        seed = None if seed is None else int(seed)  # numpy's integers too: torch's generator takes only int
        return Request(input_ids, int(max_new_tokens), strategy, seed, chain, tuple(stop), eos, **rows,
                       logprobs=None if logprobs is None else int(logprobs),
                       prompt_logprobs=None if prompt_logprobs is None else int(prompt_logprobs), shift_keep=shift_keep)

    def defaults_for(self, generation_config=None, processors_given=False, strategy=None) -> generation_defaults.GenerationDefaults:
        """What a call leaving out strategy, max_new_tokens, processors or stop takes: the model's
        `generation_defaults`, with the fields the call's `generation_config` (a dict) changes, as
        `model.generate(temperature=0.7)` keeps the model's other fields. With `processors_given`, a field
        that makes a processor is refused: the processors given are the whole list. Refused with the
        `strategy` a call gives: the config's processors with a temperature of 0 (greedy) for "sample", as
        transformers refuses it, and the call's stop strings with "beam", as its `stop` is."""
        if generation_config is None:
            return self._sampling_checked(self.generation_defaults, strategy, processors_given, "strategy")
        if not isinstance(generation_config, dict):
            raise InvalidArgument("generation_config must be a map of generation config fields to values, got "
                                  f"{type(generation_config).__name__}", option="generation_config")
        if strategy == "beam" and generation_config.get("stop_strings"):
            raise InvalidArgument("generation_config.stop_strings do not go with strategy 'beam' (beams are scored to "
                                  "their end), as stop does not", option="generation_config", field="stop_strings")
        if processors_given:
            made = [field for field, value in generation_config.items()
                    if generation_defaults.makes_processor(field, value)]
            if made:
                raise InvalidArgument(f"generation_config.{made[0]} makes a processor, and processors is given: the "
                                      "processors given are the whole list, so give it there, or leave processors "
                                      "out to change the model's one field", option="generation_config", field=made[0])
        try:
            defaults = generation_defaults.overridden(self.model.generation_config, generation_config, self.vocab_size)
        except generation_defaults.InvalidField as error:
            raise InvalidArgument(str(error), option="generation_config", field=error.field) from None
        return self._sampling_checked(defaults, strategy, processors_given,
                                      "generation_config" if "temperature" in generation_config else "strategy")

    @staticmethod
    def _sampling_checked(defaults, strategy, processors_given, option):
        """`defaults`, unless a call samples with the processors of a config whose temperature of 0 says greedy
        (which has none to sample with): transformers refuses a temperature of 0 to sample with."""
        if strategy == "sample" and defaults.zero_temperature and not processors_given:
            raise InvalidArgument("the generation config's temperature is 0, which is greedy decoding, and strategy is "
                                  "'sample': give generation_config={'temperature': t} with t > 0, or leave strategy out",
                                  option=option, **({"field": "temperature"} if option == "generation_config" else {}))
        return defaults

    @functools.cached_property
    def fingerprint(self) -> str:
        """What a saved session must have been saved from (`persist.model_fingerprint`)."""
        return persist.model_fingerprint(self.model, self.vocabulary.fingerprint)

    def restore(self, path) -> Session:
        """A new session holding what `Session.save` wrote to `path`, in this process or another one."""
        with self.lock:
            return persist.restore(self, path)

    def _check_rows(self, strategy, stop, num_samples, num_beams, num_return_sequences, length_penalty,
                    early_stopping) -> dict:
        """The options that make a generation several rows: samples, or beams and their scoring."""
        if not _is_int(num_samples) or not 1 <= num_samples <= self.max_rows:
            raise InvalidArgument(f"num_samples must be an integer in [1, {self.max_rows}], got {num_samples!r}",
                                  option="num_samples")
        if num_samples > 1 and strategy != "sample":
            raise InvalidArgument(f"num_samples goes with strategy 'sample', not {strategy!r}", option="num_samples")
        if strategy != "beam":
            given = [name for name, value in (("num_beams", num_beams), ("num_return_sequences", num_return_sequences),
                     ("length_penalty", length_penalty), ("early_stopping", early_stopping)) if value is not None]
            if given:
                also = ("; n samples are num_samples with strategy 'sample'"
                        if given[0] == "num_return_sequences" and strategy == "sample" else "")
                raise InvalidArgument(f"{given[0]} goes with strategy 'beam', not {strategy!r}{also}", option=given[0])
            return {"num_samples": int(num_samples)}
        num_beams = DEFAULT_NUM_BEAMS if num_beams is None else num_beams  # the protocol's default
        if not _is_int(num_beams) or not 1 <= num_beams <= self.max_rows:
            raise InvalidArgument(f"num_beams must be an integer in [1, {self.max_rows}], got {num_beams!r}",
                                  option="num_beams")
        num_return_sequences = 1 if num_return_sequences is None else num_return_sequences
        if not _is_int(num_return_sequences) or not 1 <= num_return_sequences <= num_beams:
            raise InvalidArgument(f"num_return_sequences must be an integer in [1, num_beams = {num_beams}], "
                                  f"got {num_return_sequences!r}", option="num_return_sequences")
        length_penalty = 1.0 if length_penalty is None else length_penalty
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, Real) or not _finite(length_penalty):
            raise InvalidArgument(f"length_penalty must be a finite number, got {length_penalty!r}", option="length_penalty")
        early_stopping = False if early_stopping is None else early_stopping
        if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
            raise InvalidArgument(f"early_stopping must be true, false or \"never\", got {early_stopping!r}",
                                  option="early_stopping")
        if stop:
            raise InvalidArgument("stop strings do not go with strategy 'beam' (beams are scored to their end)",
                                  option="stop")
        return {"num_beams": int(num_beams), "num_return_sequences": int(num_return_sequences),
                "length_penalty": float(length_penalty), "early_stopping": early_stopping}

    def _check_reuse(self, reuse, keep) -> int | None:
        """The tokens a shift keeps (`Request.shift_keep`), or None for prefix reuse."""
        if not isinstance(reuse, str) or reuse not in REUSES:
            raise InvalidArgument(f"reuse must be one of {', '.join(REUSES)}, got {reuse!r}", option="reuse")
        if reuse != "shift":
            if keep is not None:
                raise InvalidArgument(f"keep goes with reuse 'shift', not {reuse!r}", option="keep")
            return None
        if keep is not None and (not _is_int(keep) or keep < 0):
            raise InvalidArgument(f"keep must be an integer >= 0, got {keep!r}", option="keep")
        self.rotation  # a model that cannot shift is refused here, before anything changes
        return 0 if keep is None else int(keep)

    @functools.cached_property
    def rotation(self) -> shift.Rotation:
        """How `reuse="shift"` moves cached keys; raises `InvalidArgument` for a model that cannot shift."""
        return shift.Rotation.of(self.model, self.store.layers[0].head_dim)

    def check_token_ids(self, token_ids, what: str = "token ids") -> None:
        """Raises `TokenOutOfRange` naming the ids outside the vocabulary (the first five)."""
        inputs.check_token_ids(token_ids, self.vocab_size, what)

    def _touch(self, session: Session) -> None:
        self._sessions.move_to_end(session.id)
        self.store.touch(session.cache)

    def _forget(self, session: Session) -> None:
        self._sessions.pop(session.id, None)



@functools.cache
def generate_options() -> tuple[str, ...]:
    """The options of a generate call, as `Engine.validate` declares them."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in inspect.signature(Engine.validate).parameters.items()
                 if p.kind in kinds and name != "self")


def _finite(number: Real) -> bool:
    """Whether a number is finite as a float (an int past float's range is not: 10**400)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def _check_options(*, cache_budget_bytes=DEFAULT_CACHE_BUDGET, prefill_chunk=DEFAULT_PREFILL_CHUNK,
                   max_rows=DEFAULT_MAX_ROWS, share_prefixes=True) -> None:
    """Raises `InvalidArgument` naming an engine option of a value it cannot take: before a model loads
    (`Engine.load`: a bad `prefill_chunk` was refused only after the weights were read), and in `Engine`."""
    if not _is_int(prefill_chunk) or prefill_chunk < 1:
        raise InvalidArgument(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}", option="prefill_chunk")
    if not _is_int(cache_budget_bytes) or cache_budget_bytes < 0:
        raise InvalidArgument(f"cache_budget_bytes must be an integer >= 0, got {cache_budget_bytes!r}", option="cache_budget_bytes")
    if not _is_int(max_rows) or max_rows < 1:
        raise InvalidArgument(f"max_rows must be an integer >= 1, got {max_rows!r}", option="max_rows")
    if not isinstance(share_prefixes, bool):
        raise InvalidArgument(f"share_prefixes must be True or False, got {share_prefixes!r}", option="share_prefixes")


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_logprobs(option: str, k, tokens: str) -> None:
    """`logprobs` and `prompt_logprobs`: None, or how many of the most likely tokens to report, 0 to 20."""
    if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
        raise InvalidArgument(f"{option} must be an integer in [0, {MAX_LOGPROBS}] (the most likely tokens reported "
                              f"beside each {tokens} one), got {k!r}", option=option)


def _default_eos(model, tokenizer, vocab_size: int) -> frozenset[int]:
    """The ids that end a generation unless it says otherwise: the generation config's `eos_token_id`, else the
    tokenizer's EOS, less any id past the vocabulary. The model can never write those (transformers' `generate`
    runs with them, never stopping on them), and a constraint, which must be able to end, was refused for them."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = generation_defaults.end_tokens(eos)
    outside = [e for e in ids if not (_is_int(e) and 0 <= e < vocab_size)]
    if outside:
        log.warning("the model's end-of-sequence ids %s are outside its vocabulary of %d tokens: it can never write "
                    "them, and they are left out of its default eos_token_ids", outside[:5], vocab_size)
    return frozenset(e for e in ids if e not in outside)


def _naming(processor, token_id: int) -> str:
    """"option 'x' " when exactly one option of `processor` holds `token_id` (in a list, a pair or a map,
    however nested), else "": the message then names the processor alone."""
    if isinstance(processor, Compiled):  # a constraint the server compiled on a thread: its options are its own
        processor = processor.constraint
    if not dataclasses.is_dataclass(processor):
        return ""
    holding = [f.name for f in dataclasses.fields(processor) if _holds(getattr(processor, f.name), token_id)]
    return f"option {holding[0]!r} " if len(holding) == 1 else ""


def _holds(value, token_id: int) -> bool:
    if isinstance(value, Integral) and not isinstance(value, bool):
        return value == token_id
    if isinstance(value, (list, tuple)):
        return any(_holds(item, token_id) for item in value)
    if isinstance(value, dict):
        return any(_holds(key, token_id) or _holds(item, token_id) for key, item in value.items())
    return False
