"""The pure replication core (isr/core.py) on its own: each rule that a reading of the old
seam found broken (issue 28's items 1-6), as a decision with no I/O."""

from isr.core import EpochCache, LeaderCore, Verdict, push_verdict, truncation_point
from isr.state import PartitionState

A, B, C = "a:1", "b:1", "c:1"


def leader(isr=(A, B, C), min_isr=2, epoch=5, catchup=()):
    state = PartitionState(leader=A, isr=tuple(isr), catchup=tuple(catchup), epoch=epoch,
                           revision=10)
    core = LeaderCore(A, state, min_isr=min_isr, written=(0, 0), epochs=EpochCache(),
                      repl_timeout=1.0)
    core.begin()
    return core


def kinds(core):
    return [a.kind for a in core.take()]


def take_epoch(core):
    (cas,) = [a for a in core.take() if a.kind == "cas"]
    expected, new = cas.args
    core.cas_applied(new.evolve(revision=expected.revision + 1))
    return core


def test_every_leadership_asks_for_a_new_epoch_before_it_takes_a_publish():
    """Item 1: a leader that starts again within its lease does not resume at the state's
    epoch; nothing is writable or committed until etcd has the raised one."""
    core = leader(epoch=5)
    actions = core.take()
    assert [a.kind for a in actions] == ["cas"]
    assert actions[0].args[1].epoch == 6 and actions[0].args[1].leader == A
    assert not core.writable and core.written_to((10, 1)) is None
    core.cas_applied(actions[0].args[1].evolve(revision=11))
    assert core.epoch == 6 and core.writable
    assert "epoch" in kinds(core)


def test_an_overlapping_push_is_checked_never_taken_by_its_offset():
    """Item 1: a push that starts inside what the follower holds is CHECKed against the
    entries held (diskqueue compares them), not answered as a duplicate."""
    assert push_verdict(6, (A, 6), (200, 2), A, 6, (100, 1), 1) == Verdict.CHECK
    assert push_verdict(6, (A, 5), (200, 2), A, 6, (200, 2), 1) == Verdict.RECONCILE
    assert push_verdict(6, (A, 6), (200, 2), A, 7, (200, 2), 1) == Verdict.FENCE
    assert push_verdict(6, (A, 6), (200, 2), A, 5, (200, 2), 1) == Verdict.STALE


def test_a_shrink_whose_outcome_is_unknown_keeps_the_member_counting_and_is_read_back():
    """Item 2: etcd does not answer the CAS that drops a failed follower: the follower still
    counts for the commit (nothing commits past it), the partition says it is not
    writable, and the state is read back; once read, the shrink is done or tried again."""
    core = take_epoch(leader())
    core.take()
    core.written_to((100, 1))
    core.acked(B, (100, 1))
    assert core.acked(C, (50, 1)) == (50, 1)
    core.failed(C, "no ack")
    (cas,) = [a for a in core.take() if a.kind == "cas"]
    assert cas.args[1].isr == (A, B)
    core.cas_unknown()
    assert "read" in kinds(core)
    assert not core.writable and "etcd" in core.reason
    assert core.written_to((200, 2)) is None and core.acked(B, (200, 2)) is None
    assert core.committed == (50, 1)
    core.state_read(core.state)  # not applied: the same state came back
    (cas,) = [a for a in core.take() if a.kind == "cas"]
    core.cas_applied(cas.args[1].evolve(revision=20))
    assert core.state.isr == (A, B) and core.committed == (200, 2) and core.writable


def test_a_join_whose_outcome_is_unknown_is_read_back_and_counts_meanwhile():
    """Item 3: the CAS that adds a joiner loses its reply: the joiner keeps counting for
    the commit until the read back says whether etcd lists it."""
    core = take_epoch(leader(isr=(A, B), catchup=(C,)))
    core.take()
    assert core.join_begin(C)
    core.join_count(C, (0, 0))
    core.written_to((100, 1))
    assert core.acked(B, (100, 1)) is None  # waits for C too
    assert core.join_level(C) is True
    core.join_ready(C)
    (cas,) = [a for a in core.take() if a.kind == "cas"]
    core.cas_unknown()
    core.take()
    assert core.acked(B, (100, 1)) is None and core.committed == (0, 0)
    core.state_read(cas.args[1].evolve(revision=30))  # it was applied
    actions = core.take()
    assert ("joined", (C, cas.args[1].epoch)) in [(a.kind, a.args) for a in actions]
    assert C in core.state.isr and core.acked(C, (100, 1)) == (100, 1)


def test_a_solo_leader_stops_committing_on_write_once_a_joiner_counts():
    """Item 4: min_isr 1, the leader alone in its ISR commits on write (solo); from the
    moment a joiner counts, nothing commits without its ACK."""
    core = take_epoch(leader(isr=(A,), min_isr=1, catchup=(B,)))
    assert core.solo
    assert core.written_to((100, 1)) == (100, 1)
    core.join_begin(B)
    core.join_count(B, (100, 1))
    assert not core.solo and ("solo", (False,)) in [(a.kind, a.args) for a in core.take()]
    assert core.written_to((200, 2)) is None
    assert core.acked(B, (200, 2)) == (200, 2)


def test_reconcile_answers_an_epoch_not_an_offset():
    """Item 5 (KIP-279): leaders B (epoch 2), C (3), B (4), each with a tail only it holds.
    C asks B with its last epoch 3: B answers its largest epoch not above 3 (2) and where
    it ends; C cuts at its own end of epoch 2, dropping its epoch-3 records."""
    b = EpochCache([(1, (0, 0)), (2, (100, 1)), (4, (200, 2))])
    found, end = b.end_for(3, (300, 3))
    assert (found, end) == (2, (200, 2))
    c = EpochCache([(1, (0, 0)), (3, (100, 1))])
    own_end_of_2 = c.end_for(2, (200, 2))[1]  # what diskqueue's epoch_end(2) gives
    assert own_end_of_2 == (100, 1)
    assert truncation_point(end, own_end_of_2, (200, 2)) == (100, 1)
    # level: the same epoch at both, the follower behind: nothing to cut
    assert truncation_point(*b.end_for(4, (300, 3))[1:], (300, 3), (250, 2)) is None


def test_epoch_end_counts_the_pushed_tail_of_its_own_epoch_only():
    """Item 6: an EPOCH_END answered while a batch of a newer epoch is pushed (not yet
    written) gives the end of the asked epoch, not the pushed end."""
    core = take_epoch(leader(epoch=1))
    core.take()
    core.pushed_batch((0, 0), (100, 1), core.epoch)
    core.written_to((100, 1))
    core.pushed_batch((100, 1), (200, 2), core.epoch + 1)  # after an ISR change raised it
    assert core.epoch_end(core.epoch) == (core.epoch, (100, 1))
    assert core.epoch_end(core.epoch + 1) == (core.epoch + 1, (200, 2))


def test_nothing_commits_below_min_isr_and_a_newer_epoch_seen_stops_it():
    core = take_epoch(leader(isr=(A, B), min_isr=2))
    core.take()
    core.written_to((100, 1))
    assert core.acked(B, (100, 1)) == (100, 1)
    core.seen(core.state.evolve(isr=(A,), epoch=core.state.epoch + 1, revision=99))
    assert not core.writable and core.written_to((200, 2)) is None
    core.refused(B, core.state.epoch + 5)
    assert core.stopped and "seen epoch" in core.stopped


def test_a_join_asked_again_while_its_cas_is_unknown_keeps_the_joiner_counting():
    """The fault simulator's seed 13254 (min_isr 1): a leader alone in its ISR CASes joiner
    B in; the reply is lost (etcd applied it) and the read back waits for etcd; B, its own
    JOIN timed out, asks again. That JOIN is refused and B keeps counting: no commit on
    write alone (solo), none past B's ACK. (Before, join_begin started B's join afresh:
    counted no more, solo again, and the leader acknowledged batches B never had while
    etcd listed B in the ISR.)"""
    core = take_epoch(leader(isr=(A,), min_isr=1, catchup=(B,)))
    assert core.join_begin(B)
    core.join_count(B, (0, 0))
    assert core.join_level(B) is True
    core.join_ready(B)
    core.take()
    core.cas_unknown()
    assert core.join_begin(B) is None  # refused: the replica asks again
    core.take()
    assert not core.solo
    assert core.written_to((100, 1)) is None  # waits for B's ACK
    assert core.acked(B, (100, 1)) == (100, 1)


def test_a_join_asked_again_while_it_waits_behind_a_shrink_keeps_the_joiner_counting():
    """The fault simulator's seed 4544 (min_isr 1): joiner C is counted and level, its CAS
    waits behind a shrink whose outcome is unknown; C asks again. That JOIN is refused and
    C keeps counting, so the join CAS that follows never puts in the ISR a replica the
    leader committed without. (Before, the second JOIN started C's join over while it
    stayed queued for the CAS: the leader went solo, then CASed C in.)"""
    core = take_epoch(leader(isr=(A, B), min_isr=1, catchup=(C,)))
    assert core.join_begin(C)
    core.join_count(C, (0, 0))
    core.failed(B, "no ack")  # the shrink goes first
    core.join_ready(C)
    core.take()
    core.cas_unknown()
    assert core.join_begin(C) is None
    core.state_read(core.state.evolve(isr=(A,), catchup=(B, C), epoch=core.state.epoch + 1,
                                      revision=40))  # the shrink was applied
    core.take()
    assert not core.solo and C in core.counted
    assert core.written_to((100, 1)) is None  # waits for C's ACK
    assert core.acked(C, (100, 1)) == (100, 1)


def test_a_batch_that_went_to_no_follower_and_was_not_written_is_taken_back():
    """A leader alone in its ISR (a topic of one replica) whose batch failed to be written
    (a full disk) goes on from that batch's start: the next batch is pushed there, and the
    leadership goes on. A batch that went out is never taken back: the next one, behind
    what was pushed, stops the leadership."""
    core = take_epoch(leader(isr=(A,), min_isr=1))
    epoch = core.epoch
    assert core.pushed_batch((0, 0), (10, 1), epoch) == []
    assert core.written_to((10, 1)) == (10, 1)
    assert core.pushed_batch((10, 1), (20, 2), epoch) == []
    core.unwritten((10, 1))
    assert core.pushed_batch((10, 1), (30, 3), epoch) == [] and core.stopped is None
    core.pushed_batch((30, 3), (40, 4), epoch)
    assert core.pushed_batch((30, 3), (50, 5), epoch) is None and core.stopped
