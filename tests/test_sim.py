"""The deterministic fault simulator (tests/sim): the real isr.core under seeded faults.

CI: 1,000 seeds (min_isr 1 and 2, alternating); --long: 100,000. A failure names its seed;
replay it with `python -m tests.sim --seed N --trace`."""

import pytest

from sim.invariants import Violation
from sim.world import World

STEPS = 400


def run_seeds(first, count, steps=STEPS):
    failed = []
    for seed in range(first, first + count):
        try:
            World(seed, min_isr=1 + seed % 2).run(steps)
        except Violation as v:
            failed.append(f"seed {seed} step {v.step}: {v}")
    return failed


@pytest.mark.parametrize("block", range(4))
def test_seeds(block):
    failed = run_seeds(block * 250, 250)
    assert not failed, "\n".join(failed[:10])


@pytest.mark.long
@pytest.mark.parametrize("block", range(100))
def test_seeds_long(block):
    failed = run_seeds(1000 + block * 1000, 1000)
    assert not failed, "\n".join(failed[:10])


def test_replays_exactly():
    a = World(12345, trace=True)
    b = World(12345, trace=True)
    a.run(STEPS)
    b.run(STEPS)
    assert a.log_lines == b.log_lines and a.log_lines
