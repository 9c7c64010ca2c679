"""Synthetic social messages with planted events, for tests and runs that need no download.

Each event has its own keywords, hashtags, users and a burst in time; every message mixes words of
its event with background words, so the event structure is learnable but not trivial. Sites drawn
with different `site` numbers share the event vocabulary scheme but not messages, and `shift` moves a
site's events to other keywords (a heterogeneous federation).
"""

from __future__ import annotations

import numpy as np

from hpcfed.data.messages import Messages

_BACKGROUND = [f"w{i}" for i in range(200)]


def make_messages(seed: int, site: int = 0, *, num_events: int = 6, per_event: int = 40, shift: int = 0,
                  noise_words: int = 4, event_words: int = 3) -> Messages:
    """`num_events` × `per_event` messages; event e uses keyword block ``e + shift``."""
    rng = np.random.default_rng([seed, 31337, site])
    ids, texts, times, events, users, mentions, hashtags = [], [], [], [], [], [], []
    base = np.datetime64("2013-01-01T00:00:00", "s")
    for e in range(num_events):
        block = e + shift
        vocab = [f"event{block}word{j}" for j in range(8)]
        tags = [f"tag{block}x{j}" for j in range(3)]
        people = [f"user{block}p{j}" for j in range(6)]
        start = base + np.timedelta64(int(block) * 86400 * 5, "s")
        for m in range(per_event):
            words = list(rng.choice(vocab, size=event_words)) + list(rng.choice(_BACKGROUND, size=noise_words))
            rng.shuffle(words)
            tag = [str(rng.choice(tags))] if rng.random() < 0.5 else []
            men = [str(rng.choice(people))] if rng.random() < 0.3 else []
            text = " ".join(words) + "".join(f" #{t}" for t in tag) + "".join(f" @{u}" for u in men)
            ids.append(f"s{site}e{e}m{m}")
            texts.append(text)
            times.append(start + np.timedelta64(int(rng.integers(0, 86400 * 3)), "s"))
            events.append(f"event{block}")
            users.append(str(rng.choice(people)) if rng.random() < 0.5 else "")
            mentions.append(men)
            hashtags.append(tag)
    return Messages(ids, texts, np.array(times, dtype="datetime64[s]"), events, users, mentions, hashtags,
                    [[] for _ in ids], {"user": True, "mentions": True, "hashtags": True, "entities": False},
                    f"synthetic(seed={seed}, site={site})")
