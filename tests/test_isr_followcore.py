"""isr/followcore.py: the follower's decisions, event by event (no I/O, no time)."""

from isr.followcore import RETRY_FIRST, RETRY_MAX, FollowerCore, Push

A, B = "a:1", "b:1"


def push(start, end, epoch=2, leader=A, commit=(0, 0), name=None):
    n = 0 if start == end else 1
    return Push(leader, epoch, start, end, n, commit, name or f"{start[0]}-{end[0]}")


def kinds(core):
    return [s.kind for s in core.take()]


def only(core, kind):
    steps = [s for s in core.take() if s.kind == kind]
    assert len(steps) == 1, steps
    return steps[0].args


def test_a_new_leadership_is_fenced_then_reconciled_then_appended_in_one_group():
    c = FollowerCore(fence=1, end=(0, 0), last_epoch=1, join_lag=0)
    c.push(push((0, 0), (10, 1)))
    c.push(push((10, 1), (20, 2)))
    assert c.take() == [("fence", (2,))]
    c.fenced(2)
    rid, leader, epoch, last = only(c, "epoch_end")
    assert (leader, epoch, last) == (A, 2, 1)
    c.epoch_answer(rid, 1, (0, 0), (0, 0))  # nothing to cut
    steps = c.take()
    assert steps[0] == ("level", (A, 2))
    assert steps[1].kind == "append" and [p.token for p in steps[1].args[0]] == ["0-10", "10-20"]
    c.written((20, 2), 2)
    assert kinds(c) == ["commit", "answer"]


def test_pushes_wait_for_the_log_and_one_the_fence_passed_meanwhile_is_stale():
    c = FollowerCore(fence=2, end=(0, 0), last_epoch=2, join_lag=0)
    c.level = (A, 2)
    c.push(push((0, 0), (10, 1)))
    assert kinds(c) == ["append"]
    c.push(push((10, 1), (20, 2), name="waits"))  # the log is busy: it waits
    c.push(push((20, 2), (30, 3), epoch=3, leader=B, name="newer"))
    assert c.take() == []
    c.written((10, 1), 2)
    steps = c.take()
    assert [s.kind for s in steps] == ["commit", "answer", "append"]
    c.written((20, 2), 2)
    assert kinds(c) == ["commit", "answer", "fence"]  # then the newer leadership's fence
    c.push(push((20, 2), (30, 3), name="late"))  # epoch 2 arrives after the fence took 3
    c.fenced(3)
    assert [s for s in c.take() if s.kind == "answer"] == []
    assert c.fence == 3
    c.push(push((30, 3), (40, 4), name="stale"))
    assert c.take() == [("answer", ((push((30, 3), (40, 4), name="stale"),), ("stale", 3)))]


def test_the_rounds_cut_until_the_log_is_a_prefix_and_ask_again_each_time():
    c = FollowerCore(fence=3, end=(100, 10), last_epoch=3, join_lag=0)
    c.push(push((60, 6), (70, 7), epoch=3))
    rid, *_ = only(c, "epoch_end")
    c.epoch_answer(rid, 2, (50, 5), (80, 8))  # the leader's epoch 2 ends at 50; ours at 80
    assert c.take() == [("truncate", ((50, 5),))]
    c.truncated((50, 5), 2)
    rid2, _, _, last = only(c, "epoch_end")
    assert rid2 != rid and last == 2
    c.epoch_answer(rid, 2, (40, 4), (40, 4))  # the old round's late answer: ignored
    assert c.take() == []
    c.epoch_answer(rid2, 2, (60, 6), (50, 5))
    steps = c.take()
    assert steps[0] == ("level", (A, 3))
    assert steps[1] == ("answer", ((push((60, 6), (70, 7), epoch=3),), ("gap", (50, 5))))


def test_failed_rounds_refuse_the_first_push_alone():
    c = FollowerCore(fence=2, end=(0, 0), last_epoch=2, join_lag=0)
    c.push(push((0, 0), (10, 1), name="first"))
    c.push(push((10, 1), (20, 2), name="second"))
    rid, *_ = only(c, "epoch_end")
    c.request_failed(rid, "no answer")
    steps = c.take()
    assert steps[0] == ("answer", ((push((0, 0), (10, 1), name="first"),),
                                   ("failed", "reconcile: no answer", (0, 0))))
    assert steps[1].kind == "epoch_end"  # the second push asks again


def test_a_diverged_append_is_reconciled_before_anything_more_is_taken():
    c = FollowerCore(fence=2, end=(20, 2), last_epoch=2, join_lag=0)
    c.level = (A, 2)
    c.push(push((10, 1), (20, 2)))  # overlaps: the log's job compares the entries
    assert kinds(c) == ["append"]
    c.written((20, 2), 2, "not the entries held", diverged=True)
    assert c.take()[0][1][1][0] == "error" and c.level is None
    c.push(push((20, 2), (30, 3)))
    assert kinds(c) == ["epoch_end"]


def test_an_empty_push_commits_up_to_the_log_and_a_gap_is_refused():
    c = FollowerCore(fence=2, end=(20, 2), last_epoch=2, join_lag=0)
    c.level = (A, 2)
    c.push(push((30, 3), (30, 3), commit=(30, 3)))
    assert c.take() == [("commit", ((20, 2),)),
                        ("answer", ((push((30, 3), (30, 3), commit=(30, 3)),), ("ack", (20, 2))))]
    c.push(push((30, 3), (40, 4)))
    assert c.take()[0][1][1] == ("gap", (20, 2))


def catch_up(c, leader=A, epoch=2):
    c.follow(leader, epoch, outside=True)
    steps = c.take()
    if steps and steps[0].kind == "fence":
        c.fenced(epoch)
        steps = c.take()
    (rid, *_), = [s.args for s in steps if s.kind == "epoch_end"]
    c.epoch_answer(rid, epoch, c.end, c.end)
    steps = c.take()
    assert steps[0] == ("level", (leader, epoch))
    return steps[1]


def test_a_catch_up_fetches_until_the_lag_is_small_then_joins():
    c = FollowerCore(fence=1, end=(0, 0), last_epoch=1, join_lag=5)
    fetch = catch_up(c)
    assert fetch.kind == "fetch" and fetch.args[3] == (0, 0)
    rid = fetch.args[0]
    c.fetched(rid, (0, 0), 3, (100, 10), (30, 3))
    assert c.take() == [("append_fetched", (rid,))]
    c.written((30, 3), 2)
    steps = c.take()
    assert steps[0] == ("commit", ((30, 3),)) and steps[1].kind == "fetch"
    rid = steps[1].args[0]
    c.fetched(rid, (30, 3), 7, (100, 10), (100, 10))
    c.take()
    c.written((98, 9), 2)
    steps = c.take()
    assert steps[1].kind == "join" and steps[1].args[3] == (98, 9)
    c.joined(steps[1].args[0])
    assert c.catchup is None


def test_a_failed_catch_up_starts_again_after_a_pause_that_doubles():
    c = FollowerCore(fence=2, end=(0, 0), last_epoch=2, join_lag=0)
    delays = []
    fetch = catch_up(c)
    for _ in range(8):
        c.request_failed(fetch.args[0], "no answer")
        (delay,), = [s.args for s in c.take() if s.kind == "retry"]
        delays.append(delay)
        c.retry()
        (rid, *_), = [s.args for s in c.take() if s.kind == "epoch_end"]
        c.epoch_answer(rid, 2, (0, 0), (0, 0))
        fetch = next(s for s in c.take() if s.kind == "fetch")
    assert delays[0] == RETRY_FIRST and delays[1] == 2 * RETRY_FIRST
    assert max(delays) == RETRY_MAX == delays[-1]


def test_a_fetched_chunk_waits_for_a_push_group_and_is_fetched_again_when_the_end_moved():
    c = FollowerCore(fence=2, end=(0, 0), last_epoch=2, join_lag=0)
    rid = catch_up(c).args[0]
    c.push(push((0, 0), (10, 1)))
    assert kinds(c) == ["append"]  # the push group holds the log
    c.fetched(rid, (0, 0), 1, (50, 5), (0, 0))
    assert c.take() == []  # the chunk waits
    c.written((10, 1), 2)
    steps = c.take()
    assert [s.kind for s in steps] == ["commit", "answer", "fetch"]  # our end moved: again
    assert steps[2].args[3] == (10, 1)


def test_out_of_range_restarts_the_log_at_the_leaders_start():
    c = FollowerCore(fence=2, end=(10, 1), last_epoch=2, join_lag=0)
    rid = catch_up(c).args[0]
    c.out_of_range(rid, (500, 50))
    assert c.take() == [("restart", ((500, 50),))]
    c.restarted((500, 50), 0)
    assert only(c, "fetch")[3] == (500, 50)


def test_a_new_leader_drops_the_catch_up_and_its_late_answers_do_not_wedge_the_log():
    c = FollowerCore(fence=2, end=(0, 0), last_epoch=2, join_lag=0)
    c.follow(A, 2, outside=True)
    (rid, *_), = [s.args for s in c.take() if s.kind == "epoch_end"]
    c.follow(B, 3, outside=True)  # the rounds with A still hold the log
    assert c.take() == []
    c.epoch_answer(rid, 2, (0, 0), (0, 0))  # A's late answer frees it for B's catch-up
    assert [s.kind for s in c.take()] == ["fence"]
    c.fenced(3)
    (_, leader, epoch, _), = [s.args for s in c.take() if s.kind == "epoch_end"]
    assert (leader, epoch) == (B, 3)


def test_inside_the_isr_there_is_no_catch_up():
    c = FollowerCore(fence=2, end=(0, 0), last_epoch=2, join_lag=0)
    c.follow(A, 2, outside=True)
    c.take()
    c.follow(A, 2, outside=False)
    assert c.catchup is None
