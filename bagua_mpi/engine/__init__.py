"""The execution engine: buckets in profiled order, flattening, overlap with backward."""
from .buckets import Bucket, plan_buckets
from .clock import StepClock
from .engine import Engine

__all__ = ["Bucket", "Engine", "StepClock", "plan_buckets"]
