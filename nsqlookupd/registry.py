"""The registration database of classic mode: which nsqd (producer) has which topic and
channel, as Go nsqlookupd's RegistrationDB keeps it. Pure: no I/O, no event loop; every
query takes `now` (seconds), so tests drive time.

A registration is (category, key, subkey): ("client", "", "") for every identified
nsqd, ("topic", topic, "") and ("channel", topic, channel). Each holds the producers
that registered it, by peer id (the connection's remote address). A registration may
hold no producer: made through the HTTP API, or left by an UNREGISTER (only
`#ephemeral` ones go when their last producer does).

Invariants:
- One PeerInfo per connection, shared by all its registrations: a PING refreshes
  `last_update` everywhere at once.
- A producer in a topic's registration carries its own tombstone (set by
  /topic/tombstone); REGISTER again keeps it (the producer is not replaced), so a
  tombstone lasts its lifetime, or until the nsqd unregisters the topic.
- Queries never return a producer silent for longer than `inactive_timeout`; /lookup
  also hides one tombstoned less than `tombstone_lifetime` ago; /nodes shows it with
  its tombstone flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLIENT = ("client", "", "")


@dataclass(slots=True)
class PeerInfo:
    """An identified nsqd. `id` is its connection's remote address."""
    id: str
    remote_address: str
    hostname: str
    broadcast_address: str
    tcp_port: int
    http_port: int
    version: str
    last_update: float = 0.0

    def public(self) -> dict:
        """The producer as /lookup shows it."""
        return {"remote_address": self.remote_address, "hostname": self.hostname,
                "broadcast_address": self.broadcast_address, "tcp_port": self.tcp_port,
                "http_port": self.http_port, "version": self.version}

    @property
    def node(self) -> str:
        """`broadcast_address:http_port`: how /topic/tombstone names a node."""
        return f"{self.broadcast_address}:{self.http_port}"


@dataclass(slots=True)
class Producer:
    peer: PeerInfo
    tombstoned_at: float | None = None

    def tombstoned(self, now: float, lifetime: float) -> bool:
        return self.tombstoned_at is not None and now - self.tombstoned_at < lifetime


@dataclass
class RegistrationDB:
    inactive_timeout: float = 300.0
    tombstone_lifetime: float = 45.0
    registrations: dict[tuple[str, str, str], dict[str, Producer]] = field(default_factory=dict)

    # ---- changes -------------------------------------------------------------

    def add_registration(self, key: tuple[str, str, str]) -> None:
        self.registrations.setdefault(key, {})

    def add_producer(self, key: tuple[str, str, str], peer: PeerInfo) -> bool:
        """True when the peer was not yet a producer of `key` (an existing one is kept,
        with its tombstone)."""
        producers = self.registrations.setdefault(key, {})
        if peer.id in producers:
            return False
        producers[peer.id] = Producer(peer)
        return True

    def remove_producer(self, key: tuple[str, str, str], peer_id: str) -> tuple[bool, int]:
        """(removed, producers left)."""
        producers = self.registrations.get(key)
        if producers is None:
            return False, 0
        removed = producers.pop(peer_id, None) is not None
        return removed, len(producers)

    def remove_registration(self, key: tuple[str, str, str]) -> None:
        self.registrations.pop(key, None)

    def identify(self, peer: PeerInfo) -> None:
        self.add_producer(CLIENT, peer)

    def register(self, peer: PeerInfo, topic: str, channel: str | None) -> None:
        """REGISTER: the channel (when given) and its topic."""
        if channel:
            self.add_producer(("channel", topic, channel), peer)
        self.add_producer(("topic", topic, ""), peer)

    def unregister(self, peer: PeerInfo, topic: str, channel: str | None) -> None:
        """UNREGISTER of a channel, or of a topic with every channel of it; an
        `#ephemeral` one left without producers goes."""
        if channel:
            key = ("channel", topic, channel)
        else:
            for k in self.find("channel", topic, "*"):
                self.remove_producer(k, peer.id)
            key = ("topic", topic, "")
        _, left = self.remove_producer(key, peer.id)
        if left == 0 and (channel or topic).endswith("#ephemeral"):
            self.remove_registration(key)

    def disconnected(self, peer: PeerInfo) -> None:
        """The peer's connection closed: it produces nothing any more."""
        for key in [k for k, producers in self.registrations.items() if peer.id in producers]:
            self.remove_producer(key, peer.id)

    def ping(self, peer: PeerInfo, now: float) -> None:
        peer.last_update = now

    def tombstone(self, topic: str, node: str, now: float) -> None:
        """Tombstone the producers of `topic` whose `broadcast_address:http_port` is `node`."""
        for producer in self.registrations.get(("topic", topic, ""), {}).values():
            if producer.peer.node == node:
                producer.tombstoned_at = now

    def create_topic(self, topic: str) -> None:
        self.add_registration(("topic", topic, ""))

    def delete_topic(self, topic: str) -> None:
        for key in self.find("channel", topic, "*"):
            self.remove_registration(key)
        self.remove_registration(("topic", topic, ""))

    def create_channel(self, topic: str, channel: str) -> None:
        self.add_registration(("channel", topic, channel))
        self.add_registration(("topic", topic, ""))

    def delete_channel(self, topic: str, channel: str) -> bool:
        """False when the channel has no registration."""
        if ("channel", topic, channel) not in self.registrations:
            return False
        self.remove_registration(("channel", topic, channel))
        return True

    # ---- queries ---------------------------------------------------------------

    def find(self, category: str, key: str, subkey: str) -> list[tuple[str, str, str]]:
        """Registrations matching; `*` matches any key or subkey."""
        return [r for r in self.registrations
                if r[0] == category and key in ("*", r[1]) and subkey in ("*", r[2])]

    def _active(self, producers, now: float, tombstone_lifetime: float) -> list[Producer]:
        return [p for p in producers
                if now - p.peer.last_update <= self.inactive_timeout
                and not p.tombstoned(now, tombstone_lifetime)]

    def has_topic(self, topic: str) -> bool:
        return ("topic", topic, "") in self.registrations

    def topics(self) -> list[str]:
        return sorted(r[1] for r in self.find("topic", "*", ""))

    def channels(self, topic: str) -> list[str]:
        return sorted(r[2] for r in self.find("channel", topic, "*"))

    def producers(self, topic: str, now: float) -> list[dict]:
        """The active, not tombstoned producers of a topic, as /lookup shows them."""
        producers = self.registrations.get(("topic", topic, ""), {}).values()
        return [p.peer.public() for p in self._active(producers, now, self.tombstone_lifetime)]

    def nodes(self, now: float) -> list[dict]:
        """Every active nsqd, tombstoned or not, with its topics and their tombstone flags."""
        out = []
        for client in self._active(self.registrations.get(CLIENT, {}).values(), now, 0):
            peer = client.peer
            topics = sorted(r[1] for r, producers in self.registrations.items()
                            if r[0] == "topic" and peer.id in producers)
            tombstones = [self.registrations[("topic", t, "")][peer.id]
                          .tombstoned(now, self.tombstone_lifetime) for t in topics]
            out.append({**peer.public(), "tombstones": tombstones, "topics": topics})
        return out
