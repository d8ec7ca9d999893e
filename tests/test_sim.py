"""The deterministic fault simulator (tests/sim): the real isr.core under seeded faults.

CI: 1,000 seeds (min_isr 1 and 2, alternating); --long: 100,000. A failure names its seed;
replay it with `python -m tests.sim --seed N --trace`. Each bug of tests/sim/mutations.py,
put back into the core, must be found by some seed."""

import pytest

from sim.invariants import Violation
from sim.mutations import COMBINED, MUTATIONS, REGRESSIONS, mutated
from sim.world import World

STEPS = 3000
MUTATION_SEEDS = 1000  # each mutation is found within this many seeds


def run(seed, steps=STEPS):
    """The violation seed `seed` finds, or None."""
    try:
        World(seed, min_isr=1 + seed % 2).run(steps)
    except Violation as v:
        return f"seed {seed} step {v.step}: {v}"
    return None


def run_seeds(first, count):
    return [f for f in map(run, range(first, first + count)) if f]


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


@pytest.mark.parametrize("name", sorted(set(MUTATIONS) - {"b-duplicate-by-offset"}
                                        - set(REGRESSIONS.values())) + sorted(COMBINED))
def test_mutation_is_found(name):
    with mutated(name):
        for seed in range(MUTATION_SEEDS):
            if run(seed):
                return
    pytest.fail(f"mutation {name} found by none of {MUTATION_SEEDS} seeds")


def test_mutation_b_alone_is_masked_by_new_epochs():
    """(b) needs two different logs at one (leader, epoch): with a new epoch per leadership
    a follower never sees them, so it is found only together with (a) (test above)."""
    with mutated("b-duplicate-by-offset"):
        assert not run_seeds(0, 100)


@pytest.mark.parametrize("seed", sorted(REGRESSIONS))
def test_a_seed_that_found_a_bug_passes_and_finds_it_put_back(seed):
    assert run(seed) is None
    with mutated(REGRESSIONS[seed]):
        assert run(seed) is not None, f"seed {seed} no longer finds {REGRESSIONS[seed]}"
