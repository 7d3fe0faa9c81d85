"""Run in vLLM's environment (tests/test_vllm_plugin_live.py does): build vLLM 0.32's own MLAAttention
on a simulated ROCm gfx942 / gfx950 for each case and print the layers' two AITER BMM flags as JSON.

    python tests/vllm_live/policy_flags.py CASES.json   # [{"name", "checkpoint", "platform", "env", "plugin"}]

Simulated: ``vllm._aiter_ops.is_aiter_found_and_supported`` (AITER installed on CDNA 3+) and
``vllm.platforms.rocm`` (a stand-in module: ``get_cdna_version`` 3 for gfx942, 4 for gfx950; the real one reads the GPU at import); the plugin's platform detection is
given the same answer. Everything else (the environment variables through vllm.envs and
``rocm_aiter_ops.refresh_env_variables``, the flags' expressions, the kv_b_proj dtype check) is vLLM's.
Cases without the plugin run before ``register()`` is called.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

CDNA = {"rocm-gfx942": 3, "rocm-gfx950": 4}
ENV = ("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_FP8BMM", "VLLM_ROCM_USE_AITER_FP4BMM")
KV_B_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "packed": torch.uint8}


def build(case: dict, layer: int, kv_b_dtype: str) -> tuple[bool, bool]:
    import vllm._aiter_ops as aiter
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    for name in ENV:
        os.environ.pop(name, None)
    os.environ.update(case["env"])
    aiter.is_aiter_found_and_supported = lambda: True
    # vllm/platforms/rocm.py reads the GPU at import: a stand-in with the one function the flags call
    rocm = types.ModuleType("vllm.platforms.rocm")
    rocm.get_cdna_version = lambda: CDNA[case["platform"]]
    sys.modules["vllm.platforms.rocm"] = rocm
    aiter.rocm_aiter_ops.refresh_env_variables()
    cfg = VllmConfig(additional_config={"mlaq": case["plugin"]} if case["plugin"] else {})
    with set_current_vllm_config(cfg):
        kv_b = torch.nn.Linear(512, 4 * 256, bias=False, dtype=torch.bfloat16)
        kv_b.weight = torch.nn.Parameter(kv_b.weight.detach().to(KV_B_DTYPE[kv_b_dtype]), requires_grad=False)
        attn = MLAAttention(
            num_heads=4, scale=0.1, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=128,
            kv_lora_rank=512, kv_b_proj=kv_b, prefix=f"model.layers.{layer}.self_attn.attn",
        )  # fmt: skip
    return bool(attn.is_aiter_triton_fp8_bmm_enabled), bool(attn.is_aiter_triton_fp4_bmm_enabled)


def register_afresh(case: dict) -> None:
    """The plugin reads the environment once per process: install it again for this case's variables."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    import mlaq.integrations.vllm.hooks as hooks
    from mlaq.integrations.vllm import register
    from mlaq.settings import Platform

    MLAAttention.__init__ = getattr(MLAAttention.__init__, "__wrapped__", MLAAttention.__init__)
    for name in ENV:
        os.environ.pop(name, None)
    os.environ.update(case["env"])
    register()
    hooks.platform_of = lambda _p: Platform(os.environ["MLAQ_TEST_PLATFORM"])
    configure = getattr(hooks._configure, "__wrapped__", hooks._configure)

    def _configure(layer, plans):
        """What the plugin reads of the model: the checkpoint directory (config files only). Set after
        vLLM's own constructor, which reads a real ModelConfig where one is set."""
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
        fake = SimpleNamespace(model=case["checkpoint"], hf_config=SimpleNamespace(to_dict=dict))
        object.__setattr__(cfg, "model_config", fake)
        try:
            configure(layer, plans)
        finally:
            object.__setattr__(cfg, "model_config", None)

    _configure.__wrapped__ = configure
    hooks._configure = _configure


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = []
    for case in sorted(cases, key=lambda c: bool(c["plugin"])):  # without the plugin first
        os.environ["MLAQ_TEST_PLATFORM"] = case["platform"]
        if case["plugin"]:
            register_afresh(case)
        for layer, dtype in case["layers"]:
            fp8, fp4 = build(case, layer, dtype)
            out.append({"name": case["name"], "layer": layer, "fp8": fp8, "fp4": fp4})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
