"""The walk of ``flopcount.utilization(model, batch)`` through the package stays short (``benchmarks/walk.py`` says
how it is measured): at most 40 stops, no module entered from more than 5 others, and no climb back up the layers
but the timer's call of the step it times."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from walk import entered_from, walk  # noqa: E402


def test_the_walk_from_utilization_is_short():
    stops, climbs = walk()
    assert 10 < len(stops) <= 40, sorted(stops)  # more than 10: the watch saw the walk at all
    entered = {m: sorted(c) for m, c in entered_from(stops).items() if len(c) > 5}
    assert entered == {}
    assert {(s[0], s[2]) for s in climbs} <= {("flopcount.device.timing", "flopcount.analyses.utilization")}
