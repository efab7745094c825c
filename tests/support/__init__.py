"""Helpers shared by test suites (import as `tests.support`)."""
