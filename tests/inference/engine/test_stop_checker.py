from inference.engine.stop_checker import StopChecker


def feed(checker: StopChecker, pieces: list[str], token_ids: list[int] | None = None):
    text, shown = "", []
    for i, piece in enumerate(pieces):
        prev = len(text)
        text += piece
        stopped = checker.on_token(token_ids[i] if token_ids else 100 + i, text, prev)
        shown.append(checker.visible_text(text, finished=stopped))
        if stopped:
            return True, shown
    return False, shown


def test_stop_string_split_across_tokens_is_caught_and_not_returned():
    stopped, shown = feed(StopChecker(["###"], []), ["Hello", " #", "#", "# world"])
    assert stopped
    assert shown[-1] == "Hello "
    # while "#", "##" could still become "###" they are held back, never shown then retracted
    assert shown == ["Hello", "Hello ", "Hello ", "Hello "]


def test_held_back_text_is_released_when_it_cannot_become_a_stop_string():
    stopped, shown = feed(StopChecker(["###"], []), ["a #", "#b"])
    assert not stopped
    assert shown == ["a ", "a ##b"]


def test_include_stop_str_keeps_it():
    stopped, shown = feed(StopChecker(["END"], [], include_stop_str=True), ["the E", "ND and more"])
    assert stopped and shown[-1] == "the END"


def test_earliest_of_several_stop_strings_wins():
    stopped, shown = feed(StopChecker(["bb", "a"], []), ["xxbba"])
    assert stopped and shown[-1] == "xx"


def test_stop_token_text_is_not_shown():
    stopped, shown = feed(StopChecker([], [2]), ["Hi", "</s>"], token_ids=[5, 2])
    assert stopped and shown[-1] == "Hi"


def test_without_stops_everything_is_visible():
    stopped, shown = feed(StopChecker([], []), ["a", "b"])
    assert not stopped and shown == ["a", "ab"]
