"""Tokenizers other than the default byte-level BPE: SentencePiece's (a "▁" for a space, `<0xNN>` byte
tokens, a decoder that drops the space starting a text), a plain Metaspace one (T5's, XGLM's), one with a
lowercasing normalizer, and WordPiece. Found from outside (a zoo of seven tokenizers): a constraint read
"▁yes" as " yes" while the text said "yes", so `Choice([" yes"])` gave "yes"; a byte-fallback run that is
not UTF-8 lost the characters before it and the ASCII after it; llguidance raised an untyped ValueError
on a plain Metaspace decoder and forced "p" for "P" under a lowercasing normalizer; and a WordPiece
vocabulary let a regex of digits write "3 3 2"."""

import re
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from processors import Choice, Grammar, JsonSchema, Regex, SequenceBias, SuppressTokens, configure
from sidecar import Engine
from sidecar.errors import InvalidProcessor

ROOT = Path(__file__).resolve().parents[2]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
SPECIALS = ["<unk>", "<s>", "</s>"]


def engine_for(tokenizer) -> Engine:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0))
    return Engine(model, tokenizer)


def sentencepiece(words, decoder=None, normalizer=None) -> PreTrainedTokenizerFast:
    """Llama's layout (non-legacy, as transformers converts it): byte fallback, "▁" first, Strip decoder."""
    vocab = {w: i for i, w in enumerate(SPECIALS + BYTE_TOKENS + words)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoder or decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                                decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>")


@pytest.fixture(scope="module")
def llama_like():
    return engine_for(sentencepiece(["\u2581", "\u2581yes", "\u2581no", "yes", "no", "a", "b", "\u2581a", "\u2581b",
                                     "Answer", ":"]))


def forcing(ids, eos=2):
    """A processor that makes the model write exactly `ids`, then EOS."""
    def force(logits, context):
        step = context.length - context.input_length
        forced = torch.full_like(logits, float("-inf"))
        forced[:, ids[step] if step < len(ids) else eos] = 0.0
        return forced
    return force


def streamed(engine, prompt, ids):
    with engine.session() as session:
        stream = session.stream(prompt, max_new_tokens=len(ids) + 1, processors=[forcing(ids)])
        pieces = [event.text for event in stream]
    assert "".join(pieces) == stream.result.text
    return stream.result


def test_a_generation_writes_what_its_tokens_add_to_the_text_of_the_input(llama_like):
    """"▁yes" after "Answer:" writes " yes", as transformers decodes the whole sequence (and as vLLM streams
    it); decoding the generated ids alone drops the space, as the start of a text."""
    tokenizer = llama_like.tokenizer
    ids = tokenizer.convert_tokens_to_ids(["\u2581yes", "\u2581no", "a"])
    prompt = tokenizer.encode("Answer:")
    result = streamed(llama_like, "Answer:", ids)
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    assert result.text == " yes noa" == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    assert tokenizer.decode(ids) == "yes noa"  # what it is not


@pytest.mark.parametrize("tokens, text", [(["<0xE4>", "<0xB8>", "<0x96>", "<0xE7>", "\u2581b"], "世\ufffd b"),
                                          (["<0xB1>", "<0x7E>"], "\ufffd~")],
                         ids=["a character, then a byte of none", "a byte of none, then ASCII"])
def test_a_byte_fallback_run_that_is_not_utf8_writes_its_characters_as_they_are_decided(llama_like, tokens, text):
    """SentencePiece's decoder turns such a run into one U+FFFD a byte, as a whole ("���� b", "��"); the
    text kept the characters decided before (as streamed) and then wrote U+FFFD for all the rest
    ("世��� b"), or lost the ASCII. It is the bytes decoded as UTF-8, as Python decodes them."""
    ids = llama_like.tokenizer.convert_tokens_to_ids(tokens)
    written = b"".join(llama_like.vocabulary.token_bytes[i] for i in ids)
    assert streamed(llama_like, "x", ids).text == text == written.decode("utf-8", "replace")


def test_constraints_match_the_text_the_caller_gets(llama_like):
    """A constraint reads "▁yes" as " yes": so does the text now. Without the space, only tokens without
    "▁" spell the choice."""
    cases = [(configure(Choice, options=[" yes", " no"]), lambda t: t in (" yes", " no")),
             (configure(Regex, pattern=" [ab]{1,3}"), lambda t: re.fullmatch(" [ab]{1,3}", t)),
             (configure(Choice, options=["yes", "no"]), lambda t: t in ("yes", "no")),
             (configure(Grammar, grammar='start: " " ("yes" | "no")'), lambda t: t in (" yes", " no"))]
    texts = set()
    with llama_like.session() as session:
        for constraint, matches in cases:
            for seed in range(12):
                text = session.generate("Answer:", strategy="sample", seed=seed, max_new_tokens=8,
                                        processors=[constraint]).text
                assert matches(text), (constraint, seed, text)
                texts.add(text)
    assert {" yes", " no", "yes", "no"} <= texts


def test_llguidance_runs_over_a_plain_metaspace_decoder():
    """T5's and XGLM's layout: llguidance's own reading of the tokenizer raised an untyped ValueError ("can't
    determine decoder type"), `internal` over the protocol. It reads the engine's bytes now."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0), ("a", -2.0), ("b", -2.0),
              ("\u2581a", -2.0), ("{", -2.0), ("}", -2.0), ('"', -2.0), (":", -2.0), ("1", -2.0), ("n", -2.0)]
    unigram = Tokenizer(models.Unigram(pieces, 2))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    unigram.decoder = decoders.Metaspace(prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=unigram, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    engine = engine_for(tokenizer)
    engine.model.generation_config.eos_token_id = tokenizer.eos_token_id
    with engine.session() as session:
        for constraint in (configure(Grammar, grammar='start: "a b"'), configure(Regex, pattern="a b")):
            assert session.generate("x", max_new_tokens=8, processors=[constraint], eos_token_ids=[1]).text == "a b"
        number = session.generate("x", max_new_tokens=8, eos_token_ids=[1], processors=[
            configure(Grammar, grammar="%llguidance {}\nstart: %json{\"type\": \"integer\", \"minimum\": 0, \"maximum\": 9}")])
        assert re.fullmatch("[0-9]", number.text), number.text


def test_llguidance_spells_forced_text_in_its_own_bytes_under_a_lowercasing_normalizer():
    """The tokenizer lowercases what it encodes: llguidance, which tokenized forced text with it, forced "p"
    for the grammar's "P" and gave up ("forced bytes: got 'P'; applying 'p'")."""
    engine = engine_for(sentencepiece(["pa", "ulo", "\u2581pa"], normalizer=normalizers.Lowercase()))
    with engine.session() as session:
        for word in ("Paulo", "paulo"):
            result = session.generate("x", max_new_tokens=8, processors=[configure(Grammar, grammar=f'start: "{word}"')])
            assert result.text == word and result.finish_reason == "eos"


@pytest.fixture(scope="module")
def wordpiece():
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "it", "'", "s", "don", "t", ",", ".", "1", "2", "##3", "-"]
    piece = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    piece.normalizer = normalizers.BertNormalizer(lowercase=True)
    piece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    piece.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=piece, bos_token="[CLS]", eos_token="[SEP]",
                                        unk_token="[UNK]", pad_token="[PAD]", clean_up_tokenization_spaces=True)
    return engine_for(tokenizer)


def test_constraints_are_refused_over_a_wordpiece_vocabulary(wordpiece):
    """Its decoder writes a space between words and joins "##" pieces: `Regex("[0-9]{3}-[0-9]")` wrote
    "3 3 2 - 2". A constraint on text is refused, naming the decoder; a user's own automaton (over ids) runs."""
    assert not wordpiece.vocabulary.texts_join
    with wordpiece.session() as session:
        for constraint in (configure(Regex, pattern="[0-9]{3}"), configure(Choice, options=["12"]),
                           configure(JsonSchema, schema={"type": "integer"}), configure(Grammar, grammar='start: "1"')):
            with pytest.raises(InvalidProcessor, match=r"processors\[0\] .*cannot run over this tokenizer: its decoder "
                                                       r"\(WordPiece\)"):
                session.generate("it", max_new_tokens=4, processors=[constraint])
        assert session.history == []


@pytest.mark.parametrize("prompt, tokens, text", [("it", ["it", "'", "s", "1", "##3", ",", "."], " it ' s 13 , ."),
                                                   ("1", ["##3", "2"], "3 2")],
                         ids=["words", "a piece joining the input's last word"])
def test_a_wordpiece_text_is_what_its_decoding_adds_to_the_input_without_the_clean_up_of_spaces(wordpiece, prompt,
                                                                                                tokens, text):
    """transformers' clean-up (`clean_up_tokenization_spaces`) takes back spaces before punctuation, which the
    stream has sent by then: the text is the decoding without it, whole and streamed alike; and, as for any
    tokenizer, what the tokens add to the input's text (a first "##3" wrote "##3")."""
    tokenizer = wordpiece.tokenizer
    ids, given = tokenizer.convert_tokens_to_ids(tokens), tokenizer.encode(prompt)
    whole = tokenizer.decode(given + ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert streamed(wordpiece, prompt, ids).text == text == whole[len(tokenizer.decode(given, skip_special_tokens=True)):]
    if prompt == "it":
        assert tokenizer.decode(given + ids, skip_special_tokens=True) == "it it's 13,."  # with the clean-up


def test_every_sequence_of_samples_and_beams_writes_what_it_adds_to_the_input(llama_like):
    """Their texts are made apart from the stream (beams stream nothing): " yes" for "▁yes" too. (Byte tokens
    are left out: a run of them that is not UTF-8 is decoded otherwise, by design, as tested above.)"""
    tokenizer = llama_like.tokenizer
    given = tokenizer.encode("Answer:")
    before = tokenizer.decode(given, skip_special_tokens=True)
    no_bytes = configure(SuppressTokens, token_ids=tokenizer.convert_tokens_to_ids(BYTE_TOKENS))
    with llama_like.session() as session:
        for options in (dict(strategy="sample", seed=3, num_samples=3), dict(strategy="beam", num_beams=3,
                                                                             num_return_sequences=3)):
            result = session.generate(token_ids=given, max_new_tokens=6, eos_token_ids=[], processors=[no_bytes],
                                      **options)
            assert len({tuple(sequence.token_ids) for sequence in result.sequences}) == 3
            for sequence in result.sequences:
                whole = tokenizer.decode(given + sequence.token_ids, skip_special_tokens=True)
                assert sequence.text == whole[len(before):], (options, sequence)


def test_continuing_by_characters_counts_in_the_input_text_and_the_generated(llama_like):
    """`continue` with `chars` counts in the text of the sequence's tokens: the input's text, then what the
    generation added to it, as the caller got it."""
    tokenizer = llama_like.tokenizer
    ids = tokenizer.convert_tokens_to_ids(["\u2581yes", "\u2581no", "a"])
    with llama_like.session() as session:
        result = session.generate("Answer:", max_new_tokens=4, processors=[forcing(ids)])
        seen = "Answer:" + result.text
        assert seen == "Answer: yes noa"
        kept = result.sequences[0].tokens.cut(len("Answer: yes"))
        assert kept.ids == tuple(tokenizer.encode("Answer:")) + (ids[0],) and kept.text == "Answer: yes"


def test_a_grammar_runs_over_a_tokenizer_without_an_end_of_sequence_token():
    """llguidance, given no end token, made one past the vocabulary: its column, which the logits do not have,
    raised an untyped IndexError."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>"] + BYTE_TOKENS + ["\u2581a", "a", "b"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(x, special=True, normalized=False) for x in ["<unk>", "<s>"]])
    engine = engine_for(PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>",
                                                pad_token="<unk>"))
    assert engine.tokenizer.eos_token_id is None
    with engine.session() as session:
        result = session.generate("a", max_new_tokens=4, eos_token_ids=[0],
                                  processors=[configure(Grammar, grammar='start: "ab"')])
    assert (result.text, result.finish_reason) == ("ab", "eos")


def test_llguidance_spells_forced_text_with_tokens_that_spell_it_exactly():
    """Its text "abc" over tokens "ab", "a", "bc" (no "c"): the longest first match left a rest no token
    spells, and the encoder's spelling puts a space first, so llguidance gave up on a three-letter grammar."""
    unigram = Tokenizer(models.Unigram([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0), ("ab", -2.0),
                                        ("a", -2.0), ("bc", -2.0), ("x", -2.0), ("\u2581a", -2.0)], 2))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    unigram.decoder = decoders.Metaspace(prepend_scheme="always")
    engine = engine_for(PreTrainedTokenizerFast(tokenizer_object=unigram, eos_token="</s>", unk_token="<unk>",
                                                pad_token="<pad>"))
    with engine.session() as session:
        result = session.generate("x", max_new_tokens=6, eos_token_ids=[1],
                                  processors=[configure(Grammar, grammar='start: "abc"')])
    assert (result.text, result.finish_reason) == ("abc", "eos")


def test_a_grammar_writes_the_names_of_special_tokens_as_text_and_takes_added_tokens_as_text():
    """llguidance's own reading of a tokenizer spelled a grammar's "x</s>y" with the end token itself (the text
    stopped at "x"), and took the added token "<tool_call>" (not special) for a special one, which no text
    may use. Over the engine's bytes, "</s>" is text, and "<tool_call>" is its token's text."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "sidecar/default_model/tokenizer.json"),
                                        eos_token="</s>", bos_token="<s>", pad_token="<pad>")
    tokenizer.add_tokens(["<tool_call>"])
    engine = engine_for(tokenizer)
    call = tokenizer.convert_tokens_to_ids("<tool_call>")
    with engine.session() as session:
        named = session.generate("x", max_new_tokens=16, processors=[configure(Grammar, grammar='start: "x</s>y" "."')])
        assert (named.text, named.finish_reason) == ("x</s>y.", "eos") and 2 not in named.token_ids[:-1]
        added = session.generate("x", max_new_tokens=16, processors=[configure(Grammar, grammar='start: "<tool_call>x" "."'),
                                                                     configure(SequenceBias, sequence_bias=[[[call], 50.0]])])
        assert (added.text, added.finish_reason) == ("<tool_call>x.", "eos") and call in added.token_ids
