"""The packages never use `asyncio.wait_for`: on Python 3.11 it swallows a cancellation
that arrives as the awaited call finishes (the call's result or error is returned
instead), so a task cancelled by a close went on in its retry loop and the close waited
for it forever (FollowerLog's catch-up, connecting to a leader that had just stopped:
test_below_min_isr_parked_batches_fail_and_appends_are_refused hung 1 run in 30 under
load). `asyncio.timeout` delivers both."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ["commitlog", "delayqueue", "diskqueue", "isr", "jepsen", "nsqadmin", "nsqclient",
            "nsqd", "nsqlookupd", "spark", "trace"]


def test_no_package_awaits_through_asyncio_wait_for():
    found = [f"{path.relative_to(ROOT)}:{n}"
             for package in PACKAGES
             for path in sorted((ROOT / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bwait_for\(", line) and not line.lstrip().startswith("#")]
    assert found == []
