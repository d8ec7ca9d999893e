"""The cursor's arithmetic against a brute-force model, in every FIN order."""

from hypothesis import given, settings, strategies as st

from nsqd.cursor import Cursor, Ranges, Slot


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


def take_all(cursor, sizes, start, start_count):
    slots, offset = [], start
    for i, size in enumerate(sizes):
        slots.append(Slot(offset, offset + size, start_count + i))
        cursor.take(slots[-1])
        offset += size
    return slots


@settings(max_examples=300)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.data())
def test_saved_ranges_skip_exactly_the_finished_messages_after_a_restart(sizes, data):
    """Checkpoint (encoded ranges) after any FINs, restart from it, read everything again:
    exactly the unfinished messages are taken as fresh ones, and finishing them confirms all."""
    start, start_count = 1000, 7
    before = Cursor(start, start_count)
    slots = take_all(before, sizes, start, start_count)
    finished = data.draw(st.sets(st.integers(0, len(sizes) - 1)))
    for i in data.draw(st.permutations(sorted(finished))):
        before.finish(slots[i])
    saved = Ranges.decode(before.ranges().encode(limit=1 << 20))
    assert saved.pairs() == before.confirmed_segments()
    after = Cursor(before.confirmed, before.confirmed_count, saved)
    assert after.ahead_count == sum(1 for i in finished if slots[i].offset > before.confirmed)
    fresh = []
    for s in slots:
        if s.offset < after.next_read:
            continue  # inside a range taken as finished
        if after.ahead is not None and after.take_finished():
            continue
        again = Slot(s.offset, s.end, s.count)
        after.take(again)
        fresh.append(again)
    assert after.ahead is None and after.ahead_count == 0
    assert (after.next_read, after.next_count) == (before.next_read, before.next_count)
    assert sorted(s.count - start_count for s in fresh) == [
        i for i in range(len(sizes)) if i not in finished]
    assert after.confirmed_segments() == before.confirmed_segments()
    for s in reversed(fresh):
        after.finish(s)
    assert after.window_size == 0
    assert (after.confirmed, after.confirmed_count) == (before.next_read, before.next_count)


def test_saved_ranges_are_bounded_and_past_the_bound_only_come_back():
    """Past `limit` the farthest ranges are not saved: their messages are delivered again."""
    cursor = Cursor(0, 0)
    slots = take_all(cursor, [10] * 9, 0, 0)
    for i in (2, 4, 6, 8):  # ranges at messages 2, 4, 6, 8 beyond the gap at 0
        cursor.finish(slots[i])
    saved = Ranges.decode(cursor.ranges().encode(limit=2))
    assert saved.pairs() == [(20, 30), (40, 50)]
    assert Cursor(0, 0, saved).ahead_count == 2


def test_a_late_fin_after_reset_adds_no_range():
    cursor = Cursor(0, 0)
    old = take_all(cursor, [10, 10, 10], 0, 0)
    cursor.reset(0, 0)  # replay from the start: the same offsets are taken again
    new = take_all(cursor, [10, 10, 10], 0, 0)
    cursor.finish(old[1])
    assert cursor.confirmed_segments() == [] and not new[1].done


def test_damaged_saved_ranges_are_refused():
    for bad in (Ranges([5, 20], [1, 3]), Ranges([30, 40, 40, 50], [3, 4, 4, 5]),
                Ranges([40, 30], [4, 3])):
        try:
            Cursor(10, 1, bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad.pairs()} must be refused")
    try:
        Ranges.decode(b"\0" * 12)
    except ValueError:
        pass
    else:
        raise AssertionError("bytes that are not whole ranges must be refused")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.data())
def test_ranges_below_keep_exactly_what_lies_before_a_message(done, data):
    """Messages of size 10 (message i at offset 10 * i): the finished ones as merged ranges,
    cut at any message boundary, hold exactly the finished messages before it."""
    ranges = Ranges()
    for i, d in enumerate(done):
        if d:
            ranges.add(10 * i, 10 * i + 10, i, i + 1)
    cut = data.draw(st.integers(0, len(done)))
    below = ranges.below(10 * cut, cut)
    want = {i for i, d in enumerate(done[:cut]) if d}
    got = {i for s, e in zip(below.counts[0::2], below.counts[1::2]) for i in range(s, e)}
    assert got == want
    assert [(s // 10, e // 10) for s, e in below.pairs()] == list(
        zip(below.counts[0::2], below.counts[1::2]))
    assert below.beyond(-1, -1) and Ranges.decode(below.encode(4096)).pairs() == below.pairs()
