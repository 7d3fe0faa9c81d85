"""Number formats: FP8 (e4m3fn, e4m3fnuz, e5m2) with every scaling granularity, and OCP MX."""
