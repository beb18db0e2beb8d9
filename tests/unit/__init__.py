"""Tests that start no process: one interpreter, no ranks, no command line run
(tests/unit/conftest.py refuses a process start)."""
