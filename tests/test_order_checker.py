"""The order checker itself (tests/ordercheck.py): it must see a reorder and a gap."""

from ordercheck import OrderCheck, body, parse


def feed(seqs_by_key, sent=None) -> OrderCheck:
    check = OrderCheck()
    for key, seq in seqs_by_key:
        check.observe_body(body(key, seq))
    if sent is not None:
        check.finish(sent)
    return check


def test_in_order_with_duplicates_is_clean():
    c = feed([("a", 0), ("b", 0), ("a", 1), ("a", 0), ("a", 1), ("b", 1), ("a", 2)],
             {"a": 3, "b": 2})
    assert c.clean and c.duplicates == 2 and c.received == 7


def test_a_redelivered_prefix_after_a_restart_is_only_duplicates():
    c = feed([("k", i) for i in range(5)] + [("k", i) for i in range(3, 8)], {"k": 8})
    assert c.clean and c.duplicates == 2


def test_detects_a_reorder():
    c = feed([("k", 0), ("k", 2), ("k", 1), ("k", 3)])
    assert len(c.reorders) == 1 and c.reorders[0] == ("k", 1, 2)
    assert len(c.gaps) == 1  # 2 arrived while 1 was missing
    assert not c.clean


def test_detects_a_gap_in_the_middle_and_at_the_end():
    c = feed([("k", 0), ("k", 1), ("k", 3), ("j", 0)], {"k": 5, "j": 1})
    assert c.gaps == [("k", 2, 2), ("k", 4, 4)]
    assert not c.reorders and not c.clean


def test_keys_are_independent_and_parse_round_trips():
    assert parse(body("a:b", 12)) == ("a:b", 12)
    c = feed([("x", 0), ("y", 0), ("y", 1), ("x", 1)], {"x": 2, "y": 2})
    assert c.clean
