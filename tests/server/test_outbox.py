"""The async server's mailbox: one model in flight per client, the newest posted when it is free."""

from __future__ import annotations

from hpcfed.server.outbox import ModelOutbox


class _Posted:
    def __init__(self) -> None:
        self.taken = False

    def done(self) -> bool:
        return self.taken


class _Channel:
    """Records posts; a test marks a post taken, as the channel does when the peer receives it."""

    def __init__(self) -> None:
        self.posts: list[tuple[int, dict, _Posted]] = []

    def post(self, dest: int, kind: int, header: dict, tensors: dict) -> _Posted:
        out = _Posted()
        self.posts.append((dest, header, out))
        return out


def _outbox():
    state = {"version": 1}
    channel = _Channel()
    box = ModelOutbox(channel, lambda cid, answer: (3, {"version": state["version"], "answer": answer}, {}))
    return box, channel, state


def test_a_free_client_is_posted_at_once_a_busy_one_gets_the_newest_model_later():
    box, channel, state = _outbox()
    box.owe(0, answer=True)
    assert [(d, h) for d, h, _ in channel.posts] == [(1, {"version": 1, "answer": True})]
    state["version"] = 2
    box.owe(0, answer=False)  # client 0 has not taken version 1 yet: nothing is posted
    state["version"] = 3
    box.owe(0, answer=False)
    assert len(channel.posts) == 1 and box.waiting()
    channel.posts[0][2].taken = True
    box.flush()
    assert [(d, h) for d, h, _ in channel.posts][1:] == [(1, {"version": 3, "answer": False})]
    assert not box.waiting()


def test_an_owed_answer_stays_an_answer_when_a_broadcast_is_merged_into_it():
    box, channel, _ = _outbox()
    box.owe(1, answer=False)
    box.owe(1, answer=True)  # the client uploaded and waits for its answer
    box.owe(1, answer=False)  # a later broadcast must not turn the answer into a mere broadcast
    channel.posts[0][2].taken = True
    box.flush()
    assert channel.posts[-1][1]["answer"] is True


def test_clients_are_independent_and_forget_drops_what_is_owed():
    box, channel, _ = _outbox()
    box.owe(0, answer=True)
    box.owe(1, answer=True)
    box.owe(0, answer=True)
    assert [d for d, _, _ in channel.posts] == [1, 2]
    box.forget(0)
    channel.posts[0][2].taken = True
    box.flush()
    assert [d for d, _, _ in channel.posts] == [1, 2] and not box.waiting()
    box.owe(1, answer=False)
    box.forget()
    assert not box.waiting()
