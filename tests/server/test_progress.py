"""The server's console progress: done/total and an ETA from this process's own pace."""

import time

from hpcfed.server.progress import Progress, format_duration


def test_progress_counts_and_estimates_from_its_own_pace():
    p = Progress(8, done=4, unit="rounds")  # a resumed run: 4 rounds were done before this process
    assert p.describe() == "4/8 rounds"  # no pace yet, no ETA
    time.sleep(0.2)
    p.advance_to(5)
    eta = p.eta_s()
    assert eta is not None and 0.5 <= eta <= 60  # ~0.2 s per round, 3 to go (generous: a loaded machine)
    assert p.describe().startswith("5/8 rounds, ETA ")
    p.advance_to(8)
    assert p.eta_s() is None and p.describe() == "8/8 rounds"


def test_durations_read_naturally():
    assert format_duration(0.4) == "0 s" and format_duration(59) == "59 s"
    assert format_duration(125) == "2 min 05 s" and format_duration(7300) == "2 h 01 min"
