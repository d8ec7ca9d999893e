"""The cursor's arithmetic against a brute-force model, in every FIN order."""

from hypothesis import given, settings, strategies as st

from nsqd.cursor import Cursor, Slot


def model_confirmed(sizes, finished, start):
    """The first unfinished offset (or the end), computed the slow way."""
    offset = start
    for i, size in enumerate(sizes):
        if i not in finished:
            return offset, i
        offset += size
    return offset, len(sizes)


@settings(max_examples=300)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.data())
def test_confirmed_is_first_unfinished_in_any_order(sizes, data):
    start, start_count = 1000, 7
    cursor = Cursor(start, start_count)
    slots, offset = [], start
    for i, size in enumerate(sizes):
        slots.append(Slot(offset, offset + size, start_count + i))
        cursor.take(slots[-1])
        offset += size
    assert cursor.next_read == offset and cursor.next_count == start_count + len(sizes)
    order = data.draw(st.permutations(range(len(sizes))))
    finished = set()
    for i in order:
        cursor.finish(slots[i])
        finished.add(i)
        want_offset, want_index = model_confirmed(sizes, finished, start)
        assert cursor.confirmed == want_offset
        assert cursor.confirmed_count == start_count + want_index
        # finished ranges past confirmed, merged, are exactly the finished ones after the gap
        covered = sum(e - s for s, e in cursor.confirmed_segments())
        assert covered == sum(sizes[j] for j in finished if j > want_index)
    assert cursor.window_size == 0 and cursor.confirmed == offset


def test_take_must_continue_next_read():
    cursor = Cursor(0, 0)
    cursor.take(Slot(0, 10, 0))
    try:
        cursor.take(Slot(20, 30, 1))
    except ValueError:
        pass
    else:
        raise AssertionError("a gap in taken offsets must be refused")


def test_finish_after_reset_does_not_move_the_new_cursor():
    cursor = Cursor(0, 0)
    old = Slot(0, 10, 0)
    cursor.take(old)
    cursor.reset(500, 50)
    cursor.finish(old)
    assert (cursor.confirmed, cursor.confirmed_count, cursor.next_read) == (500, 50, 500)
