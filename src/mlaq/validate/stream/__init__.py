"""Layer-streaming validation (``mlaq validate CHECKPOINT --stream``): the teacher-forced measurements
of validate on a checkpoint larger than memory, one layer (and one routed expert) at a time."""

from mlaq.validate.stream.budget import DEFAULT_BUDGET, StreamConfig, parse_size
from mlaq.validate.stream.runner import StreamMeasurement, measure_stream

__all__ = ["DEFAULT_BUDGET", "StreamConfig", "StreamMeasurement", "measure_stream", "parse_size"]
