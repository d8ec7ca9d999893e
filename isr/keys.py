"""The key tree of one cluster in etcd (the tree and each value's JSON: isr/README.md).

Every key of cluster `c` is under `/nsq/<c>/`. Names that go into keys are checked here
(`BadName`), so a key never holds a `/` that would move it into another branch:
topic and channel names as NSQ allows them, node ids as `host:tcp_port`.
"""

from __future__ import annotations

import re

from nsqwire.protocol import valid_channel_name, valid_topic_name

ROOT = "/nsq/"
_CLUSTER = re.compile(r"[a-zA-Z0-9_.-]{1,64}")
_NODE_ID = re.compile(r"[^/\s]{1,255}:[0-9]{1,5}")


class BadName(ValueError):
    """A cluster, topic, channel or node name that cannot be part of a key."""


def check_cluster(cluster: str) -> str:
    if not _CLUSTER.fullmatch(cluster):
        raise BadName(f"bad cluster id {cluster!r}: 1-64 of [a-zA-Z0-9_.-]")
    return cluster


def check_node_id(node_id: str) -> str:
    """A node id is `host:tcp_port`: one nsqd process (its other ports are in its value)."""
    if not _NODE_ID.fullmatch(node_id) or not 0 < int(node_id.rsplit(":", 1)[1]) < 65536:
        raise BadName(f"bad node id {node_id!r}: host:tcp_port")
    return node_id


def check_topic(topic: str) -> str:
    if not valid_topic_name(topic):
        raise BadName(f"bad topic name {topic!r}")
    return topic


def check_channel(channel: str) -> str:
    if not valid_channel_name(channel):
        raise BadName(f"bad channel name {channel!r}")
    return channel


def check_partition(partition: int) -> int:
    if type(partition) is not int or not 0 <= partition < 1024:
        raise BadName(f"bad partition {partition!r}: 0..1023")
    return partition


def cluster_prefix(cluster: str) -> str:
    return f"{ROOT}{check_cluster(cluster)}/"


def nodes_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}nodes/"


def node(cluster: str, node_id: str) -> str:
    return nodes_prefix(cluster) + check_node_id(node_id)


def lookupd_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}lookupd/nodes/"


def lookupd(cluster: str, lookupd_id: str) -> str:
    return lookupd_prefix(cluster) + check_node_id(lookupd_id)


def lookupd_master(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}lookupd/master"


def topics_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}topics/"


def topic_prefix(cluster: str, topic: str) -> str:
    return f"{topics_prefix(cluster)}{check_topic(topic)}/"


def topic_meta(cluster: str, topic: str) -> str:
    return topic_prefix(cluster, topic) + "meta"


def channel(cluster: str, topic: str, channel_name: str) -> str:
    return f"{topic_prefix(cluster, topic)}channels/{check_channel(channel_name)}"


def partition_state(cluster: str, topic: str, partition: int) -> str:
    return f"{topic_prefix(cluster, topic)}p/{check_partition(partition)}/state"


def partition_leader(cluster: str, topic: str, partition: int) -> str:
    return f"{topic_prefix(cluster, topic)}p/{check_partition(partition)}/leader"


def load_prefix(cluster: str) -> str:
    return f"{cluster_prefix(cluster)}load/"


def load(cluster: str, node_id: str) -> str:
    return load_prefix(cluster) + check_node_id(node_id)


def parse_topic_key(cluster: str, key: str) -> tuple[str, str, str | int | None] | None:
    """Split a key under topics/ into (topic, kind, detail), or None when it is not one.

    kind is "meta" (detail None), "channel" (detail: channel name), "state" or "leader"
    (detail: partition number). Names are not checked here: the caller reports them.
    """
    prefix = topics_prefix(cluster)
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix):].split("/")
    if len(parts) == 2 and parts[1] == "meta":
        return parts[0], "meta", None
    if len(parts) == 3 and parts[1] == "channels":
        return parts[0], "channel", parts[2]
    if len(parts) == 4 and parts[1] == "p" and parts[3] in ("state", "leader") \
            and parts[2].isdigit() and len(parts[2]) <= 4:
        return parts[0], parts[3], int(parts[2])
    return None
