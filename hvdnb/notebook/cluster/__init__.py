"""The cluster of engines the notebook drives: start options (``spec``), launch, lifecycle,
side channel relay (``hub``), health, and which cluster is current (``registry``)."""
