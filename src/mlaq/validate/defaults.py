"""Defaults of ``mlaq validate``, in a module without heavy imports (the CLI parser reads them).

The default run on the bundled mlaq-tiny-4k (`make demo`: both cores) measured 72-101 s wall on an idle
AMD EPYC Zen 4 (2 vCPUs; 72.0-84.3 s in the sixth session) and 123.9 s on an AVX2-only Zen 3 VM
(bench/validate_stages.py, bench/RESULTS.md, README "The main job").
"""

from __future__ import annotations

DEFAULT_SCHEMES = ("fp8_per_tensor", "fp8_per_block", "mxfp4", "mxfp4_w4a16", "mxfp8")
MAX_DEFAULT_CONTEXT = 2048  # default --context-len: the model's context, capped (CPU emulation)
WINDOWS = 3  # teacher-forced windows of context_len tokens
BUCKETS = 8  # context-position buckets
PROMPTS = 8  # greedy generations (MTP speculative when k >= 1)
PROMPT_LEN = 256
MAX_TOKENS = 64
NUM_SPECULATIVE_TOKENS = 3
NGRAM = 4
FLIP_ROWS = 256  # query rows per window and layer for the attention flip rate
TASK_SAMPLES = 2  # long-context task samples per task and length in the default run
