"""IncrementalDetokenizer: text deltas add up to the decoded answer, partial UTF-8 characters
and possible stop-string starts are held back, a stop string cuts the text before it."""

from dflash_jax.serve.detokenize import IncrementalDetokenizer


def utf8(ids):
    """A byte-level 'tokenizer': each id is one byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def pieces(detok, tokens, chunk=1):
    out = [detok.push(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]
    return out, detok.flush()


def test_deltas_add_up_and_partial_characters_wait():
    text = "naïve café ☕!"
    detok = IncrementalDetokenizer(utf8)
    out, tail = pieces(detok, list(text.encode()))
    assert "".join(out) + tail == text == detok.text
    assert all("\ufffd" not in piece for piece in out)
    assert out[text.encode().index("☕".encode())] == ""  # the first of its three bytes


def test_stop_string_across_pushes_cuts_before_it():
    detok = IncrementalDetokenizer(utf8, stop=["STOP", "zz"])
    out, tail = pieces(detok, list(b"abc STxOP def STOP ghi"), chunk=3)
    assert "".join(out) + tail == "abc STxOP def "
    assert detok.stopped and tail == ""
    assert "ST" not in "".join(out[:2])  # "ST" was held until "x" showed it is no stop


def test_held_back_prefix_is_released_at_the_end():
    detok = IncrementalDetokenizer(utf8, stop=["<end>"])
    out, tail = pieces(detok, list(b"one <en"), chunk=2)
    assert "".join(out) == "one " and tail == "<en" and not detok.stopped


def test_tokens_counted_up_to_the_one_completing_the_stop_string():
    """A step brings several tokens at once; those past the stop string are not the answer's."""
    text = b"abc STOP def STOP ghi"
    detok = IncrementalDetokenizer(utf8, stop=["STOP"])
    pieces(detok, list(text), chunk=8)  # the first STOP completes at byte 8 (index 7), inside the first push
    assert detok.stopped and detok.num_tokens == text.index(b"STOP") + len("STOP")
    plain = IncrementalDetokenizer(utf8)
    pieces(plain, list(text), chunk=8)
    assert plain.num_tokens == len(text)


def test_the_stop_string_completed_first_wins_however_the_tokens_are_grouped():
    """"y33|" starts before "33" but ends after it: token by token "33" stops the text first,
    and a step bringing several tokens at once must give the same text and count."""
    text = list(b"k)y3\x003|L")
    answers = set()
    for chunk in (1, 2, 3, 8):
        detok = IncrementalDetokenizer(lambda ids: bytes(i for i in ids if i).decode(), stop=["y33|", "33"])
        out, tail = pieces(detok, text, chunk)
        answers.add(("".join(out) + tail, detok.num_tokens))
    assert answers == {("k)y", 6)}


def test_stop_strings_wait_for_min_tokens():
    """vLLM's min_tokens: a stop string ending within the first min_tokens - 1 tokens is text;
    one ending later stops it, however the tokens are grouped."""
    text = list(b"ab-cd-ef-gh")
    answers = set()
    for chunk in (1, 4, 11):
        detok = IncrementalDetokenizer(utf8, stop=["-"], min_tokens=5)
        out, tail = pieces(detok, text, chunk)
        answers.add(("".join(out) + tail, detok.num_tokens))
    assert answers == {("ab-cd", 6)}  # the "-" at token 3 is too early; the one at token 6 stops
