"""Defaults of ``mlaq validate``, in a module without heavy imports (the CLI parser reads them).

The default run on the bundled mlaq-tiny-4k (`make demo`: both cores) takes one to two minutes on 2 vCPUs;
its measured times and stages are in bench/RESULTS.md ("`mlaq validate`: the default run").
"""

from __future__ import annotations

DEFAULT_SCHEMES = ("fp8_per_tensor", "fp8_per_block", "mxfp4", "mxfp4_w4a16", "mxfp8")
MAX_DEFAULT_CONTEXT = 2048  # default --context-len: the model's context, capped (CPU emulation)
WINDOWS = 1  # teacher-forced windows of context_len tokens (each adds ~16 s to the default run on 2 cores)
BUCKETS = 8  # context-position buckets
PROMPTS = 8  # greedy generations (MTP speculative when k >= 1)
PROMPT_LEN = 256
MAX_TOKENS = 64
NUM_SPECULATIVE_TOKENS = 3
NGRAM = 4
FLIP_ROWS = 256  # query rows per window and layer for the attention flip rate
TASK_SAMPLES = "needle=30,multikey=30,copy=2,vartrack=2"  # per task at the full context (tasks/spec.py)
