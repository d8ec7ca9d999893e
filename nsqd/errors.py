"""The node's failures and what a client is told of each: one table, ANSWERS, read by the
TCP server (`tcp_error`) and the HTTP API (`http_error`).

A leaf: it imports nothing from nsqd/, so every module of the node can import it. The
table holds the answers shared by every call site; where the answer depends on the call
(E_PUB_FAILED or E_SUB_FAILED, 503 <command>_FAILED, INVALID_TOPIC or
INVALID_ARG_CHANNEL), the call site builds it and the table says None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diskqueue.errors import NotCommitted
from isr.leader import NotWritable
from nsqwire import errors as wire


class NameError_(ValueError):
    """A topic or channel name that NSQ refuses."""


class TopicNotFound(LookupError):
    """A topic this node does not have, with auto-create off (E_TOPIC_NOT_EXIST). Its
    argument is the topic's name."""


class TopicConflict(ValueError):
    """A topic created again with another partition count."""


class PartitionNotFound(LookupError):
    """A partition number outside the topic's 0..partition_num-1 (E_BAD_PARTITION)."""


class PartitionNotLed(LookupError):
    """A partition of the topic that this node does not lead (E_FAILED_ON_NOT_LEADER);
    None: a publish without a partition, while this node leads none of the topic's (and
    could not forward it: nsqd/forward.py). `leader`: the partition's leader's TCP address
    when this node knows it, and `detail`: more to say; both are in the answer."""

    def __init__(self, partition: int | None, leader: str | None = None, detail: str = ""):
        super().__init__(partition)
        self.partition, self.leader, self.detail = partition, leader, detail

    def text(self) -> str:
        led = f"partition {self.partition} is led by {self.leader}" if self.leader else ""
        return "; ".join(t for t in (led, self.detail) if t)


class PartitionNotWritable(NotWritable):
    """A led partition of a replicated topic that takes no publish now: its replication has
    not started, or its in-sync replica set is below min_isr (E_FAILED_ON_NOT_WRITABLE;
    HTTP 503). The text says why. Also what a written batch fails with when the ISR fell
    below min_isr before it committed (its data may still commit: the publisher retries)."""


class BadSequence(ValueError):
    """An idempotent producer's request refused for its sequence, nothing of it written
    (nsqd/producers.py): a gap after the last one taken, or older than those kept."""


class ProducersLoading(Exception):
    """An idempotent producer's request to a partition whose producer table is still being
    read from its log: the caller awaits `partition.load_producers()` and publishes again."""

    def __init__(self, partition):
        super().__init__(partition.number)
        self.partition = partition


class HalfNotFound(LookupError):
    """No half message of that id is known to the partition (never one, or forgotten:
    nsqd/halves.py)."""


class HalfDecided(ValueError):
    """A half message's decision sent after the other one was taken."""


class HalfFailed(Exception):
    """A half command that wrote nothing: the partition's half messages are being read
    back, or too many wait; the producer may send it again."""


class StorageError(Exception):
    """The node's storage refused: a partition does not serve (see topic.py's
    invariants), or a topic or channel could not be made (a full disk). The text says
    which and why; TCP answers E_PUB_FAILED / E_SUB_FAILED with it, HTTP 503."""


class ClusterUnavailable(StorageError):
    """A write to the cluster's metadata that could not be done (etcd away, no placement)."""


# (command, exception, the partition the request named) -> the TCP error frame
TcpAnswer = Callable[[str, Exception, "int | None"], wire.ProtocolError]


@dataclass(frozen=True)
class Answer:
    """What a client is told of one failure. `tcp`: builds the error frame (its E_* code,
    text, and fatality: nsqwire.errors; the partition errors are non-fatal for publishes,
    fatal for the rest); `http`: (status, body). None: the call site says."""

    tcp: TcpAnswer | None
    http: tuple[int, str] | None


ANSWERS: dict[type[Exception], Answer] = {
    TopicNotFound: Answer(
        tcp=lambda command, e, partition: wire.topic_not_exist(e.args[0], command),
        http=None),  # HTTP: /pub of a missing topic is 404 E_TOPIC_NOT_EXIST, not raised
    PartitionNotFound: Answer(
        tcp=lambda command, e, partition: wire.bad_partition(command, str(partition)),
        http=(400, "BAD_PARTITION")),
    PartitionNotLed: Answer(
        tcp=lambda command, e, partition: wire.not_leader(command, e.text()),
        http=(400, "E_FAILED_ON_NOT_LEADER")),
    NotWritable: Answer(  # PartitionNotWritable too
        tcp=lambda command, e, partition: wire.not_writable(command),
        http=(503, "E_FAILED_ON_NOT_WRITABLE")),
    NotCommitted: Answer(  # written, its outcome unknown (CommitTimeout too): the text says so
        tcp=lambda command, e, partition: wire.not_writable(command, str(e)),
        http=(503, "E_FAILED_ON_NOT_WRITABLE")),
    BadSequence: Answer(
        tcp=lambda command, e, partition: wire.bad_sequence(command, str(e)),
        http=(400, "BAD_SEQUENCE")),
    HalfNotFound: Answer(
        tcp=lambda command, e, partition: wire.half_failed(command, "E_HALF_NOT_FOUND", str(e)),
        http=(404, "HALF_NOT_FOUND")),
    HalfDecided: Answer(
        tcp=lambda command, e, partition: wire.half_failed(command, "E_HALF_DECIDED", str(e)),
        http=(409, "HALF_DECIDED")),
    HalfFailed: Answer(
        tcp=lambda command, e, partition: wire.half_failed(command, "E_HALF_FAILED", str(e)),
        http=(503, "HALF_FAILED")),
    TopicConflict: Answer(tcp=None, http=(409, "TOPIC_PARTITION_NUM_CONFLICT")),
    # TCP: a publish's topic etcd could not make is E_TOPIC_NOT_EXIST, a SUB's E_SUB_FAILED
    ClusterUnavailable: Answer(tcp=None, http=(503, "CLUSTER_UNAVAILABLE")),
}
# Not in the table, answered by their call sites: NameError_ (HTTP 400 INVALID_TOPIC or
# INVALID_ARG_CHANNEL) and StorageError (E_PUB_FAILED / E_SUB_FAILED; 503 <what>_FAILED).


def answer(exc: BaseException) -> Answer | None:
    """The table's entry of `exc`'s class or its nearest base class in the table."""
    for cls in type(exc).__mro__:
        found = ANSWERS.get(cls)
        if found is not None:
            return found
    return None


def tcp_error(command: str, exc: Exception, partition: int | None = None) -> wire.ProtocolError:
    """The TCP error frame of `exc` for `command` (a request naming `partition`). Only for
    exceptions the table answers over TCP (KeyError otherwise: a call site's bug)."""
    found = answer(exc)
    if found is None or found.tcp is None:
        raise KeyError(f"no TCP answer for {type(exc).__name__}")
    return found.tcp(command, exc, partition)


def http_error(exc: Exception) -> tuple[int, str]:
    """The HTTP (status, body) of `exc`. Only for exceptions the table answers over HTTP
    (KeyError otherwise: a call site's bug)."""
    found = answer(exc)
    if found is None or found.http is None:
        raise KeyError(f"no HTTP answer for {type(exc).__name__}")
    return found.http
