"""What a model's generation config says a generate call does when the call does not say.

transformers' `generate`, vLLM (`--generation-config auto`) and Bumblebee all start from the model's
`generation_config.json`: its `do_sample`, `temperature`, `top_p`, `repetition_penalty`... are the
model author's defaults (Llama 3 and Qwen2.5 ship sampling ones). Here they are read once, at load, into
a strategy and built-in processors, in the order transformers' `_get_logits_processor` applies them;
a call that leaves out `strategy`, `max_new_tokens`, `processors` or `stop` takes the model's, and a call
that gives one takes exactly what it gives (`processors=[]` is none at all).

A `temperature` of 0 with `do_sample` is greedy, as vLLM reads it (transformers refuses it); token ids past
the vocabulary are left out of the lists that name them, as transformers' processors pass over them.
Only what the file sets counts, as vLLM reads it: transformers also fills in its library defaults, so that
a file that sets `do_sample` alone samples among transformers' top 50 there, and among every token here.
The sampling processors apply with `strategy="sample"` only, as transformers applies its warpers with
`do_sample` only. Fields with no counterpart among the built-ins (`forced_eos_token_id`, `guidance_scale`, a
`num_beams` above 1, `max_length`, which counts the prompt...) are not applied, and named in `not_applied`
and in the log at load; `max_new_tokens` is 16 where the config does not say.

A call may change some of the fields (`overridden`), as `model.generate(temperature=0.7)` and vLLM's
per-field override do: the model's other fields stay. The call's values are checked as a call's options
are (a value no built-in takes is refused, naming the field), where the model's own are logged and passed over.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from transformers import GenerationConfig

import processors as proc

log = logging.getLogger("sidecar")

# (generation config field, built-in, its option, the value that does nothing), in transformers' order
ANY_STRATEGY = (
    ("sequence_bias", "sequence_bias", "sequence_bias", None),
    ("repetition_penalty", "repetition_penalty", "penalty", 1.0),
    ("no_repeat_ngram_size", "no_repeat_ngram", "ngram_size", 0),
    ("bad_words_ids", "no_bad_words", "bad_words_ids", None),
    ("min_length", "min_length", "min_length", 0),
    ("min_new_tokens", "min_new_tokens", "min_new_tokens", 0),
    ("forced_bos_token_id", "forced_bos", "token_id", None),
    ("suppress_tokens", "suppress_tokens", "token_ids", None),
    ("begin_suppress_tokens", "suppress_tokens_at_begin", "token_ids", None),
)
SAMPLING = (
    ("temperature", "temperature", "temperature", 1.0),
    ("top_h", "top_h", "h", None),
    ("top_k", "top_k", "k", 0),
    ("top_p", "top_p", "p", 1.0),
    ("min_p", "min_p", "p", None),
    ("typical_p", "typical_p", "p", 1.0),
    ("epsilon_cutoff", "epsilon_cutoff", "epsilon", 0.0),
    ("eta_cutoff", "eta_cutoff", "epsilon", 0.0),
)
NEEDS_EOS = {"min_length", "min_new_tokens"}  # transformers leaves these out without an EOS
TAKES_EOS = {"no_bad_words"} | NEEDS_EOS  # given the end tokens there are (bad words keep them allowed)
# Saying nothing about what is generated here; then the fields read elsewhere
SILENT = {"bos_token_id", "pad_token_id", "decoder_start_token_id", "use_cache", "cache_implementation",
          "transformers_version", "output_scores", "output_logits", "output_attentions", "output_hidden_states",
          "return_dict_in_generate"}
READ = {"do_sample", "eos_token_id", "stop_strings", "max_new_tokens"} | SILENT
NO_EFFECT = {"num_beams": 1, "remove_invalid_values": False,
             "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0,
             "diversity_penalty": 0.0, "num_beam_groups": 1, "renormalize_logits": False, "low_memory": False,
             "num_return_sequences": 1, "length_penalty": 1.0, "early_stopping": False}
DEFAULT_MAX_NEW_TOKENS = 16  # where the config does not say (transformers' max_length of 20 counts the prompt)
INERT = {field: inert for field, _, _, inert in ANY_STRATEGY + SAMPLING}  # each processor field's neutral value
CALL_FIELDS = tuple(INERT) + ("do_sample", "max_new_tokens", "stop_strings")  # what a call may change


# What a call changing these fields of its config means here instead
INSTEAD = {"eos_token_id": "give the end tokens as eos_token_ids",
           "num_beams": "beam search is strategy='beam' with num_beams",
           "num_return_sequences": "give num_samples (sampling) or num_return_sequences (beam search)",
           "max_length": "give max_new_tokens (max_length counts the prompt)",
           **{field: "it says nothing about the tokens generated here: leave it out" for field in SILENT},
           **{field: "give logprobs=k for each token's log-probability under the model and the k most likely"
              for field in ("output_logits", "output_scores")}}


class InvalidField(ValueError):
    """A call's change of the generation config that the engine cannot apply: `field` names it."""

    def __init__(self, message: str, field):
        super().__init__(message)
        self.field = str(field)[:64]


def makes_processor(field: str, value) -> bool:
    """Whether a call's `field` at `value` makes a processor (its neutral value, a penalty of 1, does not; true
    for a number is no neutral value, and is refused)."""
    return field in INERT and (isinstance(value, bool) or not _neutral(value, INERT[field]))


def _neutral(value, inert) -> bool:
    """What transformers applies to no effect: nothing, a penalty of 1, no suppressed tokens."""
    return value is None or value == inert or (isinstance(value, (list, tuple, dict)) and not value)


@dataclass(frozen=True)
class GenerationDefaults:
    strategy: str  # "sample" when the config says do_sample, else "greedy"
    max_new_tokens: int
    processors: tuple[tuple[str, dict], ...]  # (built-in, options) with any strategy
    sampling: tuple[tuple[str, dict], ...]  # with "sample" only
    stop: tuple[str, ...]
    not_applied: tuple[str, ...]  # fields set that nothing here applies
    zero_temperature: bool = False  # greedy, whatever do_sample says: no processors to sample with

    def processors_for(self, strategy: str, eos_token_ids, input_length: int) -> list:
        """The model's processors for a call of `strategy` that ends on `eos_token_ids`, after `input_length`
        input tokens. After a one-token input a forced BOS is the first token generated, and the tokens the
        config suppresses at the beginning are suppressed at the next one, as transformers'
        `_get_logits_processor` sets their `begin_index`."""
        specs = self.processors + (self.sampling if strategy == "sample" else ())
        eos = sorted(eos_token_ids)
        forced_first = input_length == 1 and any(name == "forced_bos" for name, _ in specs)
        made = []
        for name, options in specs:
            if name in NEEDS_EOS and not eos:
                continue
            if name in TAKES_EOS and eos:
                options = {**options, "eos_token_ids": eos}
            if name == "suppress_tokens_at_begin" and forced_first:
                options = {**options, "begin_index": input_length + 1}
            made.append(proc.from_name(name, options))
        return made

    def describe(self) -> dict:
        """For a model's info: processors as the protocol names them (those that need the end tokens take
        the call's)."""
        def wire(specs):
            return [{"name": name, "options": options} for name, options in specs]

        return {"strategy": self.strategy, "max_new_tokens": self.max_new_tokens, "processors": wire(self.processors),
                "sampling_processors": wire(self.sampling), "stop": list(self.stop), "not_applied": list(self.not_applied)}


_UNSET = object()


def changes_of(config: GenerationConfig, model_config: GenerationConfig) -> dict:
    """The fields a transformers `GenerationConfig` object sets, as a call's changes: `generate` fills the
    fields it leaves unset from the model's config, as `model.generate(generation_config=config)` does in
    transformers 5. Fields that say nothing about the tokens generated here, which such an object carries
    (`model.generation_config`, `GenerationConfig.from_pretrained`: its pad and bos tokens, `use_cache`), are
    left out, and so are those it sets to the model's own values (its end tokens, a `max_length` that does
    nothing here): they change nothing."""
    model = model_config.to_dict()

    def unchanged(field, value):
        if field == "eos_token_id":  # one id or a list of them
            return set(end_tokens(value)) == set(end_tokens(model.get(field)))
        return value == model.get(field, _UNSET) or value == NO_EFFECT.get(field, _UNSET)  # num_return_sequences=1 too

    return {field: value for field, value in config.to_diff_dict().items()
            if field not in SILENT and not unchanged(field, value)}


def end_tokens(eos) -> list:
    """An `eos_token_id` as transformers keeps it (None, an id, or a list of ids) as a list."""
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


def overridden(generation_config, changes: dict, vocab_size: int) -> GenerationDefaults:
    """The defaults of a call that changes the fields `changes` names (among `CALL_FIELDS`) of the model's
    `generation_config`; the others stay the model's. Raises `InvalidField` for a field not among them, a
    value of None (a field is left out to keep the model's, or given its neutral value to turn it off), and a
    value the engine would not apply (a `top_p` of 1.5, a token id past `vocab_size`)."""
    for field, value in changes.items():
        if field in INSTEAD:
            raise InvalidField(f"generation_config.{field}: {INSTEAD[field]}", field)
        if field not in CALL_FIELDS:
            raise InvalidField(f"generation_config has no field {str(field)[:64]!r} the engine applies; valid: "
                               f"{', '.join(CALL_FIELDS)} (beams: strategy and num_beams)", field)
        if value is None:
            raise InvalidField(f"generation_config.{field} is nil: leave the field out to keep the model's, or give "
                               "its neutral value to turn it off", field)
        if isinstance(value, bool) != (field == "do_sample"):  # true == 1.0: read as a neutral value, it was no error
            raise InvalidField(f"generation_config.{field} must be true or false, got {str(value)[:64]}" if field == "do_sample"
                               else f"generation_config.{field} is {str(value).lower()}, which is no number or list", field)
    merged = copy.deepcopy(generation_config)
    for field, value in changes.items():
        setattr(merged, field, value)
    return of(merged, vocab_size, strict=frozenset(changes))


def of(generation_config, vocab_size: int, strict: frozenset = frozenset()) -> GenerationDefaults:
    """Reads the fields of a transformers `GenerationConfig` that the model's files set (transformers 5 leaves
    the others None). A value no built-in takes (a `top_p` of 1.5, a token id past `vocab_size`) is not
    applied, and logged; in a field of `strict` (a call's own), it raises `InvalidField`, and nothing is
    logged (the model's own fields were, at load)."""
    not_applied = []

    def passed_over(field, message, *args):
        if field in strict:
            raise InvalidField(f"generation_config.{field}: " + message % args, field)
        if not strict:
            log.warning(f"the model's generation config has {field} = %s, " + message + ": not applied",
                        str(getattr(generation_config, field))[:100], *args)
        not_applied.append(field)

    def specs(table):
        made = []
        for field, name, option, inert in table:
            value = getattr(generation_config, field, None)
            if _neutral(value, inert):
                continue
            value = _wire(value)
            if field not in strict:  # a call's own are refused (below) rather than cut
                value = _within(field, value, vocab_size, quiet=bool(strict))
                if value is None:
                    continue
            try:
                made_one = proc.from_name(name, {option: value, **({"eos_token_ids": [0]} if name in NEEDS_EOS else {})})
                if made_one.max_token_id() >= vocab_size:
                    raise proc.InvalidOption(f"token id {made_one.max_token_id()} is past the vocabulary of {vocab_size}")
            except proc.ProcessorError as problem:
                passed_over(field, "which %s does not take (%s)", name, problem)
                continue
            made.append((name, {option: value}))
        return tuple(made)

    # transformers' min_new_tokens replaces its min_length (as the prompt's length + min_new_tokens)
    # (any count, 0 included: min_length becomes the prompt's length, which bounds nothing)
    min_new_tokens = getattr(generation_config, "min_new_tokens", None)
    counts = isinstance(min_new_tokens, int) and not isinstance(min_new_tokens, bool) and min_new_tokens >= 0
    shadowed = {"min_length"} if counts else set()
    processors = specs(tuple(row for row in ANY_STRATEGY if row[0] not in shadowed))
    # a temperature of 0 with do_sample: greedy, as vLLM reads it (transformers refuses it)
    greedy = generation_config.temperature == 0 and not isinstance(generation_config.temperature, bool)
    # checked all the same: a call's top_p of 1.5 beside its temperature 0 is refused
    sampling = specs(tuple(row for row in SAMPLING if not (greedy and row[0] == "temperature")))
    if greedy:
        sampling = ()
    known = {field for field, *_ in ANY_STRATEGY + SAMPLING} | READ
    declared = vars(GenerationConfig())  # a file's own keys (Qwen's "chat_format") are no generation option
    for field, value in sorted(vars(generation_config).items()):
        if field in declared and field not in known and not field.startswith("_") and value is not None \
                and value != NO_EFFECT.get(field, object()):
            not_applied.append(field)
    stop = generation_config.stop_strings
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:
        if stop is not None:
            passed_over("stop_strings", "no list of non-empty strings")
        stop = ()
    max_new_tokens = generation_config.max_new_tokens
    if max_new_tokens is not None and not (isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool)
                                           and max_new_tokens >= 0):
        passed_over("max_new_tokens", "no count of tokens")
        max_new_tokens = None
    if not_applied and not strict:
        log.warning("the model's generation config sets %s, which the engine does not apply", ", ".join(not_applied))
    return GenerationDefaults("sample" if generation_config.do_sample and not greedy else "greedy",
                              DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
                              processors, sampling, stop, tuple(not_applied), greedy)


def _within(field: str, value, vocab_size: int, quiet: bool = False):
    """`value` less the token ids past the vocabulary, which the model can never write (transformers' processors
    pass over them): out of a list of ids, the ids; out of sequences of ids or biases, the sequences. None
    when nothing is left."""
    def inside(ids):
        return all(not isinstance(t, int) or t < vocab_size for t in ids)

    if field in ("suppress_tokens", "begin_suppress_tokens") and isinstance(value, list):
        kept = [t for t in value if not isinstance(t, int) or t < vocab_size]
    elif field == "bad_words_ids" and isinstance(value, list):
        kept = [ids for ids in value if not isinstance(ids, list) or inside(ids)]
    elif field == "sequence_bias" and isinstance(value, list):
        kept = [pair for pair in value if not (isinstance(pair, list) and pair and isinstance(pair[0], list))
                or inside(pair[0])]
    else:
        return value
    if len(kept) < len(value) and not quiet:
        log.warning("the model's generation config's %s names token ids past its vocabulary of %d tokens: those are "
                    "left out", field, vocab_size)
    return kept or None


def _wire(value):
    """A config value as the protocol carries it: tuples as lists, a sequence_bias keyed by tuples as pairs."""
    if isinstance(value, dict):
        return [[list(key) if isinstance(key, tuple) else key, bias] for key, bias in value.items()]
    if isinstance(value, tuple):
        return [_wire(v) for v in value]
    return value
