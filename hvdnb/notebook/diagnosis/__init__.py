"""Diagnosis of a running cell: the stall line of ranks waiting on their peers (``stall``)
and every rank's live stack (``where``). Never: interrupt or change a rank."""
