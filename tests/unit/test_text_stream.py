from hetero_spec.text_stream import TextAssembler

PIECES = {1: "Hel".encode(), 2: "lo".encode(), 3: " wor".encode(), 4: "ld".encode(), 5: "é".encode()[:1],
          6: "é".encode()[1:], 7: "###".encode()}


def test_utf8_split_across_tokens_is_joined():
    a = TextAssembler(PIECES.__getitem__)
    assert a.feed([1, 5]) == "Hel"  # half a character is held back
    assert a.feed([6]) == "é"
    assert a.finish() == "" and a.text == "Helé"


def test_stop_string_cuts_and_is_never_released():
    a = TextAssembler(PIECES.__getitem__, stop=("lo w",))
    shown = a.feed([1]) + a.feed([2]) + a.feed([3, 4])
    assert a.stopped and shown == "Hel" and a.text == "Hel"


def test_text_that_cannot_start_a_stop_string_is_released_early():
    a = TextAssembler(PIECES.__getitem__, stop=("###",))
    assert a.feed([1, 2]) == "Hel"  # the last two characters might begin "###"
    assert a.finish() == "lo"
