"""What a channel counts: messages and bytes each way, crypto time, polling, and every refusal."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChannelStats:
    """Counters of one channel (this rank); `rejected` and `rejected_by_rank` name every refusal."""

    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0  # frame bytes put on the wire
    bytes_received: int = 0  # frame bytes taken off the wire, rejected ones included
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> frames
    rejected_by_rank: dict[int, int] = field(default_factory=dict)  # rank -> frames
    seal_s: float = 0.0  # seconds spent encrypting frames (this thread's wall time in AES-GCM)
    open_s: float = 0.0  # seconds spent authenticating and decrypting frames
    polls: int = 0  # Iprobe calls: how often the channel looked for a frame
    idle_sleeps: int = 0  # back-off sleeps while waiting (an idle rank sleeps, it does not spin)
    dropped_chunks: int = 0  # later chunks of a message refused at its first chunk, dropped unread
    abandoned_frames: int = 0  # frames announced whose rest never came (their sender ended or stalled)
    # Message bytes (the bundles, before sealing) per peer rank: what an operator's live view shows
    sent_to: dict[int, int] = field(default_factory=dict)
    received_from: dict[int, int] = field(default_factory=dict)

    def count_sent(self, dest: int, nbytes: int) -> None:
        """One message of `nbytes` bundle bytes to rank `dest`."""
        self.messages_sent += 1
        self.sent_to[dest] = self.sent_to.get(dest, 0) + nbytes

    def count_received(self, src: int, nbytes: int) -> None:
        """One message of `nbytes` bundle bytes taken from rank `src` (decoded, not yet read)."""
        self.messages_received += 1
        self.received_from[src] = self.received_from.get(src, 0) + nbytes

    def count_rejection(self, src: int, reason: str) -> None:
        """One frame from rank `src` refused for `reason`."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        self.rejected_by_rank[src] = self.rejected_by_rank.get(src, 0) + 1

    def as_dict(self) -> dict[str, object]:
        """The counters as JSON-ready values (rank keys as strings, in rank order)."""
        return {"messages_sent": self.messages_sent, "messages_received": self.messages_received,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "seal_s": self.seal_s, "open_s": self.open_s,
                "polls": self.polls, "idle_sleeps": self.idle_sleeps, "dropped_chunks": self.dropped_chunks,
                "abandoned_frames": self.abandoned_frames,
                "rejected": dict(self.rejected),
                "rejected_by_rank": {str(k): v for k, v in sorted(self.rejected_by_rank.items())}}
