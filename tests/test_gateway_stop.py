"""Stop strings: matched across token boundaries, never emitted, suspicious text held until resolved."""

from gateway.decode.stop import StopMatcher, find_stop, partial_stop_len


def _run(chunks: list[str], stops: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.push(c) for c in chunks]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


def test_pure_helpers():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x"]) is None
    assert partial_stop_len("hello EN", ["END"]) == 2
    assert partial_stop_len("hello E", ["END", "EXIT"]) == 1
    assert partial_stop_len("hello", ["END"]) == 0
    assert partial_stop_len("END", ["END"]) == 0  # a whole match is find_stop's business


def test_stop_split_across_chunks_is_cut_and_never_emitted():
    out, stopped = _run(["Hello E", "N", "D world"], ["END"])
    assert stopped
    assert "".join(out) == "Hello "
    assert out[0] == "Hello "  # "E" was held back


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop():
    out, stopped = _run(["ab", "c", "x"], ["abcd"])
    assert not stopped
    assert out == ["", "", "abcx", ""]


def test_held_text_is_released_at_the_end():
    out, stopped = _run(["ends with ab"], ["abc"])
    assert not stopped
    assert "".join(out) == "ends with ab"
    assert out == ["ends with ", "ab"]


def test_earliest_of_several_stops_wins():
    out, _ = _run(["one two three"], ["three", "two"])
    assert "".join(out) == "one "


def test_char_by_char_equals_all_at_once():
    text = "The answer is 42.\n\nUser: next"
    for stops in (["\n\nUser:"], ["42"], ["zzz"], ["ne", "s 4"]):
        whole, _ = _run([text], stops)
        chars, _ = _run(list(text), stops)
        assert "".join(whole) == "".join(chars)


def test_no_stops_is_a_pass_through():
    m = StopMatcher([])
    assert m.push("abc") == "abc"
    assert m.flush() == ""
    assert StopMatcher(["", ""]).push("x") == "x"
