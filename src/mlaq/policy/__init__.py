"""Re-quantization policy: which BMM scheme each MLA layer gets, and why."""
