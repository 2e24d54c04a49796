"""The cluster of engines the notebook drives: start options, launch, lifecycle, side
channel relay, health."""
