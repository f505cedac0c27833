"""Measurement: pure figures from a request's marks, every metric, precision labels, the
recorder, and the summary table. Imports nothing else of phasewatch."""
