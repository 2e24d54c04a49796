"""Notebook side of the live panel: every point the ranks sent, runs, knob requests, views."""
