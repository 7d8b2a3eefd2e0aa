"""Incremental detokenization and stop strings (runtime/engine/detokenizer.py).

The detokenizer's contract: the concatenated deltas equal a one-shot `tokenizer.decode` of the
generated ids, and no delta carries U+FFFD from a character split across tokens. The texts
below are chosen so that naive per-token decoding breaks on them (asserted), i.e. the check
has teeth. Tokenizers are local (converted SmolLM2, in-memory tiny ones); nothing downloads.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builder.tiny import _CORPUS, make_tokenizer
from runtime.engine.detokenizer import DetokenizedStream, IncrementalDetokenizer, StopStringMatcher
from runtime.engine.fast_detokenizer import (
    ByteLevelDetokenizer,
    Detokenizers,
    StreamDetokenizer,
    byte_level_tables,
)
from runtime.engine.tokenizer import encode_prompt

TEXTS = [
    "Hello, world! How are you today? I'm fine -- thanks.",
    "   leading spaces and  double  spaces ",
    "line one\nline two\n\n  indented line\n",
    "def add(a, b):\n    if a:\n        return a + b\n\treturn None  # tab\n",
    "你好，世界。東京は日本の首都です",
    "I love 🚀 and 😀👍🏽",
    "naïve café, Übermensch, señor",
    "mixed: 東京 🚀 naïve\n    code()",
]
HARD = ["你好，世界。東京は日本の首都です", "I love 🚀 and 😀👍🏽"]


@pytest.fixture(scope="session")
def smollm2_tok():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from builder.sources import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m").checkpoint_dir, local_files_only=True)


@pytest.fixture(scope="session")
def tiny_tok():
    return make_tokenizer()


def make_sentencepiece_style_tokenizer():
    """Llama-style BPE: '▁' word marker, byte fallback, decoder strips the first leading space.

    Here decoding one token alone drops its leading space, the case the prefix offset exists for.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(_CORPUS[:4] * 4, trainer)
    # Byte tokens must be ordinary vocab (as in Llama), not special tokens that decode skips.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.fixture(scope="session")
def sp_tok():
    return make_sentencepiece_style_tokenizer()


# Each detokenizer test runs over all three (fast_detokenizer.py): Python, DecodeStream's, and the byte table's.
BOTH = pytest.mark.parametrize("kind", ["python", "stream", "byte-level"])


def make_detokenizer(tok, prompt_ids: list[int], skip_special_tokens: bool = True, kind: str = "python"):
    if kind == "stream":
        return StreamDetokenizer(tok.backend_tokenizer, prompt_ids, skip_special_tokens)
    if kind == "byte-level":
        tables = byte_level_tables(tok.backend_tokenizer)
        assert tables is not None, "a ByteLevel tokenizer"
        return ByteLevelDetokenizer(tables[1] if skip_special_tokens else tables[0])
    return IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)


def stream_deltas(tok, prompt_ids: list[int], ids: list[int], skip_special_tokens: bool = True,
                  kind: str = "python") -> list[str]:  # fmt: skip
    detok = make_detokenizer(tok, prompt_ids, skip_special_tokens, kind)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


def chat_prompt(tok) -> list[int]:
    return encode_prompt(tok, "Say something.", chat=True)


# ---------------------------------------------------------------- incremental detokenizer


@BOTH
@pytest.mark.parametrize("tok_name", ["smollm2_tok", "tiny_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_equal_full_decode(request, tok_name: str, text: str, kind: str) -> None:
    tok = request.getfixturevalue(tok_name)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    deltas = stream_deltas(tok, chat_prompt(tok), ids, kind=kind)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas), deltas


@BOTH
@pytest.mark.parametrize("text", HARD)
def test_naive_per_token_decode_is_broken(smollm2_tok, text: str, kind: str) -> None:
    """The inputs exercise split characters: decoding token by token yields U+FFFD."""
    ids = smollm2_tok.encode(text, add_special_tokens=False)
    naive = "".join(smollm2_tok.decode([i]) for i in ids)
    assert "\ufffd" in naive
    assert naive != text
    assert "".join(stream_deltas(smollm2_tok, chat_prompt(smollm2_tok), ids, kind=kind)) == text


@pytest.mark.parametrize("kind", ["python", "stream"])  # (a SentencePiece-style decoder: no byte table)
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_style_spaces(sp_tok, text: str, kind: str) -> None:
    """Per-token decode drops word spaces; with prompt context the stream keeps them all.

    With such tokenizers the first output token's leading space is real text in context, so the
    invariant is decode(prompt) + deltas == decode(prompt + ids), not decode(ids) alone.
    """
    prompt = sp_tok.encode("Say", add_special_tokens=False)
    ids = sp_tok.encode(text, add_special_tokens=False)
    deltas = stream_deltas(sp_tok, prompt, ids, kind=kind)
    assert sp_tok.decode(prompt) + "".join(deltas) == sp_tok.decode(prompt + ids)
    assert not any("\ufffd" in d for d in deltas)
    if " " in text.strip():
        assert "".join(sp_tok.decode([i]) for i in ids) != sp_tok.decode(ids)


@BOTH
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm2_tok, skip: bool, kind: str) -> None:
    tok = smollm2_tok
    ids = tok.encode("I love 🚀", add_special_tokens=False)
    ids = [*ids[:3], tok.eos_token_id, *ids[3:], tok.eos_token_id]
    deltas = stream_deltas(tok, chat_prompt(tok), ids, skip_special_tokens=skip, kind=kind)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert ("<|im_end|>" in expected) is not skip


@BOTH
def test_unfinished_character_released_by_flush(tiny_tok, kind: str) -> None:
    ids = tiny_tok.encode("ok 😀", add_special_tokens=False)
    detok = make_detokenizer(tiny_tok, [], kind=kind)
    text = "".join(detok.add(i) for i in ids[:-1])  # the emoji's last byte never comes
    assert "\ufffd" not in text
    assert text + detok.flush() == tiny_tok.decode(ids[:-1])


@BOTH
def test_prompt_ending_mid_character(tiny_tok, kind: str) -> None:
    """Raw-id prompts may split a character; the output then decodes exactly like decode(ids)."""
    ids = tiny_tok.encode("東京 ok", add_special_tokens=False)
    assert "\ufffd" in tiny_tok.decode(ids[:1])
    assert "".join(stream_deltas(tiny_tok, ids[:1], ids[1:], kind=kind)) == tiny_tok.decode(ids[1:])


@BOTH
@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 487), max_size=40), prompt=st.lists(st.integers(3, 487), max_size=8))
def test_random_ids_equal_full_decode(tiny_tok, ids: list[int], prompt: list[int], kind: str) -> None:
    """Arbitrary ids, invalid UTF-8 included: still exactly decode(ids), by the end."""
    for skip in (True, False):
        assert "".join(stream_deltas(tiny_tok, prompt, ids, skip, kind)) == tiny_tok.decode(
            ids, skip_special_tokens=skip
        )


# ---------------------------------------------------------------- stop strings


def run_matcher(matcher: StopStringMatcher, chunks: list[str], expected: str) -> tuple[str, bool]:
    """Feed chunks; at every step what was emitted must be a prefix of the final answer."""
    out, stopped = "", False
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out += text
        assert expected.startswith(out), (out, expected)
        if stopped:
            break
    if not stopped:
        out += matcher.flush()
    assert out == expected
    return out, stopped


def test_no_stops_passthrough() -> None:
    m = StopStringMatcher([])
    assert m.feed("anything END") == ("anything END", False)
    assert m.flush() == ""


def test_stop_split_across_every_pair_of_points() -> None:
    text = "Hello world! END trailing"
    for stops, expected in ((["END"], "Hello world! "), (["world"], "Hello ")):
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                m = StopStringMatcher(stops)
                _, stopped = run_matcher(m, [text[:i], text[i:j], text[j:]], expected)
                assert stopped and m.matched == stops[0]


def test_hello_world_chunks() -> None:
    m = StopStringMatcher(["world!"])
    assert m.feed("Hello wor") == ("Hello ", False)  # "wor" may begin the stop: held
    assert m.feed("ld! END") == ("", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_partial_stop_released_when_not_a_stop() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("The E") == ("The ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("d of it") == ("ENd of it", False)
    assert m.feed(" E") == (" ", False)
    assert m.flush() == "E"  # generation ended (EOS): the held text was no stop


def test_include_stop_str_in_output() -> None:
    text = "abc STOP def"
    for i in range(len(text) + 1):
        m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
        assert run_matcher(m, [text[:i], text[i:]], "abc STOP") == ("abc STOP", True)


def test_multiple_stops_earliest_wins() -> None:
    for stops in (["STOP", "END"], ["END", "STOP"]):
        m = StopStringMatcher(stops)
        assert run_matcher(m, ["a EN", "D b STOP c"], "a ") == ("a ", True)
        assert m.matched == "END"


def test_overlapping_stops_first_completed_wins() -> None:
    """Stop "BC" completes inside "ABCD" before it does, however the text is split."""
    text = "xABCD"
    for i in range(len(text) + 1):
        m = StopStringMatcher(["ABCD", "BC"])
        run_matcher(m, [text[:i], text[i:]], "xA")
        assert m.matched == "BC"
    m = StopStringMatcher(["C", "ABC"])  # same end: the longer (earlier) one wins
    assert m.feed("xABC") == ("x", True)


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


ALPHABET = "abEND "


@settings(max_examples=500, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
    stop=st.text(ALPHABET, min_size=1, max_size=4),
    include=st.booleans(),
)
def test_property_single_stop(pieces: list[str], stop: str, include: bool) -> None:
    text = "".join(pieces)
    i = text.find(stop)
    expected = text if i < 0 else text[: i + len(stop) if include else i]
    _, stopped = run_matcher(StopStringMatcher([stop], include), pieces, expected)
    assert stopped == (i >= 0)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_property_multiple_stops(pieces: list[str], stops: list[str]) -> None:
    """Cut where the first stop completes; splitting text differently never changes the result."""
    text = "".join(pieces)
    hits = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    expected = text if not hits else text[: sum(min(hits))]
    run_matcher(StopStringMatcher(stops), pieces, expected)
    run_matcher(StopStringMatcher(stops), list(text), expected)


# ---------------------------------------------------------------- combined stream


def test_stream_without_stop_equals_decode(smollm2_tok) -> None:
    tok = smollm2_tok
    text = "你好，世界。 I love 🚀 END"
    ids = tok.encode(text, add_special_tokens=False)
    stream = DetokenizedStream(Detokenizers(tok)(chat_prompt(tok)), stops=["ENDX"])
    outs = [stream.add(i) for i in ids]
    assert not any(stopped for _, stopped in outs)
    assert stream.finish().endswith("END")  # held back as a possible "ENDX" until the end
    assert stream.text == text
    assert not any("\ufffd" in o for o, _ in outs)


@pytest.mark.parametrize("include", [False, True])
def test_stream_stop_inside_split_characters(smollm2_tok, include: bool) -> None:
    """A CJK stop string spans byte-level tokens; the stream stops on it mid-generation."""
    tok = smollm2_tok
    text = "前言：你好，世界。東京は日本の首都です"
    ids = tok.encode(text, add_special_tokens=False)
    stream = DetokenizedStream(Detokenizers(tok)(chat_prompt(tok)), ["世界", "首都"], include)
    expected = "前言：你好，世界" if include else "前言：你好，"
    emitted = ""
    for i in ids:
        out, stopped = stream.add(i)
        emitted += out
        assert "\ufffd" not in out
        assert expected.startswith(emitted)  # never a partial character or partial stop
        if stopped:
            break
    assert stopped and len(stream.detokenizer.output_ids) < len(ids)
    assert stream.add(ids[-1]) == ("", True)
    assert stream.finish() == ""
    assert emitted == stream.text == expected


def test_the_fastest_detokenizer_that_decodes_alike(smollm2_tok, sp_tok) -> None:
    assert isinstance(Detokenizers(smollm2_tok)([1, 2]), ByteLevelDetokenizer)
    assert isinstance(Detokenizers(sp_tok)([1, 2]), StreamDetokenizer)  # its decoder strips and replaces
    sp_tok.clean_up_tokenization_spaces = True  # transformers' clean-up runs in Python: the Python detokenizer
    try:
        assert isinstance(Detokenizers(sp_tok)([1, 2]), IncrementalDetokenizer)
    finally:
        sp_tok.clean_up_tokenization_spaces = False


@pytest.mark.parametrize("skip", [True, False])
def test_byte_table_decodes_every_token_as_the_tokenizer(smollm2_tok, skip: bool) -> None:
    """The table is built by hand from the ByteLevel decoder's rule: each of SmolLM2's 49,152 tokens, and a
    random run of them, decode alike (replacement characters of invalid bytes included)."""
    import random

    backend = smollm2_tok.backend_tokenizer
    table = byte_level_tables(backend)[1 if skip else 0]
    assert len(table) == backend.get_vocab_size()
    for token_id, raw in enumerate(table):
        assert raw.decode("utf-8", "replace") == backend.decode([token_id], skip_special_tokens=skip), token_id
    ids = random.Random(0).choices(range(len(table)), k=5000)
    assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == backend.decode(ids, skip_special_tokens=skip)


def test_byte_table_check_catches_a_wrong_byte(smollm2_tok) -> None:
    table = list(byte_level_tables(smollm2_tok.backend_tokenizer)[0])
    table[300] = table[300] + b"x"
    detok = ByteLevelDetokenizer(table)
    text = "".join(detok.add(i) for i in [299, 300, 301]) + detok.flush()
    assert text != smollm2_tok.decode([299, 300, 301])
