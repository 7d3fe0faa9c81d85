"""torch's oneDNN caches (``mlaq.settings.bound_onednn_caches``): a bf16 GEMM of a new shape leaves a
primitive in oneDNN's cache and a primitive descriptor in ideep's, ~0.55 MB, up to 1,024 shapes each by
default. The engine makes new shapes all the time (an expert's row count follows the routing, a prefill's
the prompts' lengths), so mlaq caps both before the first GEMM. The probe runs in a fresh interpreter:
the caches read their capacity once per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import SRC
from mlaq.settings import ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_VARIABLES, bound_onednn_caches

SHAPES = 400  # distinct GEMM row counts: ~220 MB of cache entries uncapped, ~35 MB at 64 shapes
PROBE = """
import ctypes, gc, os, sys, torch
import torch.nn.functional as F
from mlaq.bundled import bundled_model_dir
from mlaq.model.layers.linear import onednn_bf16_gemm
from mlaq.model.loading.loader import load_model

torch.set_num_threads(1)
model = load_model(bundled_model_dir(), dtype=torch.bfloat16)  # caps the caches before its first GEMM
if not onednn_bf16_gemm():
    print("skip"); sys.exit()
weight = model.model.layers[0].mlp.gate_proj.weight  # (I, H) bf16
x = torch.randn(SHAPES + 2, weight.shape[1], dtype=torch.bfloat16)
trim = ctypes.CDLL("libc.so.6").malloc_trim
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
gc.collect(); trim(0); before = rss()
for rows in range(2, SHAPES + 2):  # as the MoE's experts and a server's prefills do: a new M each call
    F.linear(x[:rows], weight)
gc.collect(); trim(0)
print(rss() - before)
""".replace("SHAPES", str(SHAPES))


def test_caps_unset_and_empty_variables() -> None:
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": " ", "OTHER": "x"}
    assert bound_onednn_caches(env) == dict.fromkeys(ONEDNN_CACHE_VARIABLES, str(ONEDNN_CACHE_CAPACITY))
    assert env["OTHER"] == "x"
    assert bound_onednn_caches({}, capacity=8) == dict.fromkeys(ONEDNN_CACHE_VARIABLES, "8")


def test_the_users_values_win() -> None:
    env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "0"}
    assert bound_onednn_caches(env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "0"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm and glibc's malloc_trim")
def test_new_gemm_shapes_after_load_model_stay_bounded() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env["PYTHONPATH"] = str(SRC)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    if out == ["skip"]:
        pytest.skip("torch runs bf16 GEMMs without oneDNN here (no AVX-512 BF16 / AMX): nothing cached")
    grown_mb = float(out[-1])
    # capped: ~64 shapes x ~0.55 MB; uncapped the same loop keeps all 400 (~220 MB)
    assert grown_mb < 0.4 * SHAPES * 0.55, f"RSS grew {grown_mb:.0f} MB over {SHAPES} GEMM shapes"
