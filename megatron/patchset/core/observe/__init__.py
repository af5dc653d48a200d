"""Observe patches: exact per-iteration metrics and one profiled iteration. They record what
training does and change no computation (``kind="observe"``)."""
