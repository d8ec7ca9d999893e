"""Bugs put back into isr.core, one at a time, to show the simulator is not blind."""

import contextlib

MUTATIONS = {}


@contextlib.contextmanager
def mutated(name):
    yield
