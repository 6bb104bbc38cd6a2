"""Shared pytest configuration: the hypothesis profiles (``ci`` derandomised, ``dev`` random),
defined once in ``foxhunt.conformance.strategies``."""

from foxhunt.conformance.strategies import load_hypothesis_profile

load_hypothesis_profile()
