import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tokenizers_for_tests import bytelevel, llama_like  # noqa: E402

from triton_glue.detokenizer import (PREFIX_WINDOW, IncrementalDetokenizer, decode_delta,  # noqa: E402
                                     full_text, token_bytes)

TEXTS = ["Hello naïve 😀 world 中文 ß and more words", "  two  spaces, tabs\tand\nnew lines ☃☃",
         "東京 in the café — résumé 😀😀 end"]
TOKENIZERS = {"llama_like": llama_like, "bytelevel": bytelevel}


@pytest.fixture(params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


@pytest.fixture(params=["bytes", "window"])
def method(request):
    return request.param


def chunks(ids, rng):
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 5])
        out.append(ids[i:i + n])
        i += n
    return out


def stream_stateless(tok, prompt, ids, cs, method):
    seq, out = list(prompt), []
    for k, c in enumerate(cs):
        out.append(decode_delta(tok, seq[-PREFIX_WINDOW:], c, final=(k == len(cs) - 1), method=method))
        seq += c
    return out


def test_byte_method_is_selected_for_both_tokenizer_families(tok):
    assert token_bytes(tok).ok


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_concatenate_to_the_text(tok, method, text):
    prompt = tok.encode("Prompt:", add_special_tokens=False)
    ids = tok.encode(" " + text, add_special_tokens=False)
    ref = tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt)):]
    assert full_text(tok, prompt, ids) == ref  # spaces and multi-byte characters intact
    rng = random.Random(0)
    for trial in range(20):
        d = IncrementalDetokenizer(tok, prompt, method=method)
        assert d.method == method
        cs = chunks(ids, rng)
        pieces = [d.add(c) for c in cs] + [d.finish()]
        assert "".join(pieces) == ref
        assert all("\ufffd" not in p for p in pieces), pieces  # no half characters streamed
        assert "".join(stream_stateless(tok, prompt, ids, cs, method)) == ref


def test_output_from_sequence_start_matches_decode(tok):
    ids = tok.encode("Hello naïve 😀 world", add_special_tokens=True)
    ref = tok.decode(ids, skip_special_tokens=True)
    d = IncrementalDetokenizer(tok, [])
    assert "".join(d.add([t]) for t in ids) + d.finish() == ref
    assert decode_delta(tok, [], ids, final=True) == ref


def test_leading_space_of_first_token_kept(method):
    tok = llama_like()
    prompt = tok.encode("Hello", add_special_tokens=False)
    ids = tok.encode("Hello world", add_special_tokens=False)[len(prompt):]
    assert not tok.decode(ids).startswith(" ")  # the per-chunk bug this module avoids
    d = IncrementalDetokenizer(tok, prompt, method=method)
    assert "".join(d.add([t]) for t in ids) + d.finish() == " world"


def test_incomplete_character_held_then_completed(method):
    tok = llama_like()
    ids = [t for t in tok.encode("中", add_special_tokens=False) if tok.decode([t]) != ""]
    assert len(ids) == 3  # three byte-fallback pieces
    d = IncrementalDetokenizer(tok, tok.encode("a", add_special_tokens=False), method=method)
    assert d.add(ids[:2]) == ""
    assert d.add(ids[2:]) == "中"
    d = IncrementalDetokenizer(tok, tok.encode("a", add_special_tokens=False), method=method)
    assert d.add(ids[:2]) == ""
    assert set(d.finish()) == {"\ufffd"}  # a truncated character is flushed as U+FFFD
    pre = tok.encode("a", add_special_tokens=False)
    assert decode_delta(tok, pre, ids[:2], final=False, method=method) == ""
    assert decode_delta(tok, pre + ids[:2], ids[2:], final=False, method=method) == "中"


def test_random_token_soup_is_chunking_invariant(tok):
    """Random ids (what a random-weight model emits), invalid UTF-8 included: with the byte
    method the streamed text never depends on chunking, stateful or stateless."""
    rng = random.Random(2)
    prompt = tok.encode("x", add_special_tokens=False)
    for trial in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        ref = full_text(tok, prompt, ids)
        for _ in range(3):
            cs = chunks(ids, rng)
            d = IncrementalDetokenizer(tok, prompt)
            assert "".join(d.add(c) for c in cs) + d.finish() == ref
            assert "".join(stream_stateless(tok, prompt, ids, cs, "bytes")) == ref
        # and it is what the tokenizer itself decodes, whenever that is well defined
        if "\ufffd" not in ref:
            assert ref == tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt)):]
