"""Benchmark of ``mlaq validate --stream`` on a synthetic checkpoint several times larger than its budget.

    python bench/validate_stream.py [--dir ~/.cache/mlaq-bench] [--budget 2GiB] [--keep]

Per format (bf16, then DeepSeek's FP8 128x128 blocks): writes a random checkpoint with DeepSeek-V3's
real attention shapes (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128),
fewer routed experts (16 of moe_intermediate 2048, 2 per token, 1 shared), 4 MoE layers + 1 MTP layer,
a small vocabulary, one shard per layer; evicts it from the page cache (fsync + POSIX_FADV_DONTNEED:
reads come from the disk); measures the cold sequential read speed of one shard; then runs the streamed
validation in a fresh process (so its peak RSS is the run's, not the writer's) under the budget, and
prints wall time, peak RSS, bytes read and the per-layer phases. Finally projects the time for
DeepSeek-V3 671B (FP8) from those measurements (see ``project``). The checkpoints are deleted unless
--keep. Not a test: figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 7168, 128, 1536, 512, 128, 64, 128
MOE_I, DENSE_I, VOCAB = 2048, 18432, 8192
BENCH = {"layers": 4, "experts": 16, "per_token": 2}
DEEPSEEK_V3 = {"layers": 61, "dense": 3, "experts": 256, "per_token": 8, "vocab": 129280, "mtp": 1}
RUN = {"windows": 1, "context_len": 128, "schemes": ("fp8_per_tensor", "mxfp4"), "flip_rows": 0}


def config(fmt: str) -> dict:
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "intermediate_size": DENSE_I,
        "moe_intermediate_size": MOE_I,
        "num_hidden_layers": BENCH["layers"],
        "first_k_dense_replace": 0,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": V_HEAD,
        "n_routed_experts": BENCH["experts"],
        "num_experts_per_tok": BENCH["per_token"],
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if fmt == "fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    return cfg


def layer_linears(prefix: str, experts: int, mtp: bool) -> dict[str, tuple[int, int]]:
    """Linear weights (out, in) of one DeepSeek-V3 MoE decoder layer."""
    a = prefix + "self_attn."
    out = {
        a + "q_a_proj": (Q_LORA, H),
        a + "q_b_proj": (HEADS * (NOPE + ROPE), Q_LORA),
        a + "kv_a_proj_with_mqa": (KV_LORA + ROPE, H),
        a + "kv_b_proj": (HEADS * (NOPE + V_HEAD), KV_LORA),
        a + "o_proj": (H, HEADS * V_HEAD),
    }
    for e in [*(f"experts.{i}" for i in range(experts)), "shared_experts"]:
        m = f"{prefix}mlp.{e}."
        out |= {m + "gate_proj": (MOE_I, H), m + "up_proj": (MOE_I, H), m + "down_proj": (H, MOE_I)}
    if mtp:
        out[prefix + "eh_proj"] = (H, 2 * H)
    return out


def _linear(name: str, shape: tuple[int, int], fmt: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out, k = shape
    if fmt == "bf16" or name.endswith("eh_proj"):
        return {name + ".weight": (torch.randn(shape, generator=gen) * k**-0.5).to(torch.bfloat16)}
    # e4m3 codes without the NaN encodings (0x7F, 0xFF); per-block scales give an RMS of about k^-1/2
    mag = torch.randint(0, 0x7F, shape, dtype=torch.uint8, generator=gen)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7
    codes = (mag | sign).view(torch.float8_e4m3fn)
    grid = (math.ceil(out / 128), math.ceil(k / 128))
    scale = torch.full(grid, k**-0.5 / 120.0) * (1 + 0.1 * torch.rand(grid, generator=gen))
    return {name + ".weight": codes, name + ".weight_scale_inv": scale}


def _evict(path: Path) -> None:
    """Drop a written file from the page cache so the run reads it from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_checkpoint(path: Path, fmt: str) -> int:
    """One shard per layer (+ one for embed / norm / head); returns the bytes written."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    cfg = config(fmt)
    n = cfg["num_hidden_layers"]
    weight_map: dict[str, str] = {}
    total = n + 2
    bytes_written = 0

    def save(tensors: dict[str, torch.Tensor], index: int) -> None:
        nonlocal bytes_written
        fname = f"model-{index:05d}-of-{total:05d}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        _evict(path / fname)
        bytes_written += (path / fname).stat().st_size
        weight_map.update(dict.fromkeys(tensors, fname))

    def ones() -> torch.Tensor:  # a fresh tensor each time: safetensors refuses shared storage
        return torch.ones(H, dtype=torch.bfloat16)

    save(
        {
            "model.embed_tokens.weight": torch.randn(VOCAB, H, generator=gen).to(torch.bfloat16),
            "model.norm.weight": ones(),
            "lm_head.weight": (torch.randn(VOCAB, H, generator=gen) * H**-0.5).to(torch.bfloat16),
        },
        1,
    )
    for i in range(n + 1):  # the last one is the MTP layer
        p = f"model.layers.{i}."
        mtp = i == n
        t: dict[str, torch.Tensor] = {
            p + "input_layernorm.weight": ones(),
            p + "post_attention_layernorm.weight": ones(),
            p + "self_attn.q_a_layernorm.weight": torch.ones(Q_LORA, dtype=torch.bfloat16),
            p + "self_attn.kv_a_layernorm.weight": torch.ones(KV_LORA, dtype=torch.bfloat16),
            p + "mlp.gate.weight": (torch.randn(BENCH["experts"], H, generator=gen) * H**-0.5).to(
                torch.bfloat16
            ),
            p + "mlp.gate.e_score_correction_bias": torch.zeros(BENCH["experts"]),
        }
        for name, shape in layer_linears(p, BENCH["experts"], mtp).items():
            t |= _linear(name, shape, fmt, gen)
        if mtp:
            t |= {
                p + "enorm.weight": ones(),
                p + "hnorm.weight": ones(),
                p + "shared_head.norm.weight": ones(),
            }
            t[p + "embed_tokens.weight"] = torch.randn(VOCAB, H, generator=gen).to(torch.bfloat16)
            t[p + "shared_head.head.weight"] = (torch.randn(VOCAB, H, generator=gen) * H**-0.5).to(
                torch.bfloat16
            )
        save(t, i + 2)
        del t
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    _tokenizer(path)
    return bytes_written


def _tokenizer(path: Path) -> None:
    """A character-level tokenizer.json (the vocabulary's first 96 ids) and a code-like held-out text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(chars)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": None}))
    lines = [
        f"def f{i % 17}(x, y={i % 5}):\n    return x * {i % 11} + y - {(i * 7) % 13}\n" for i in range(400)
    ]
    (path / "heldout.txt").write_text("".join(lines))


def disk_read_speed(file: Path, chunk: int = 64 * 2**20) -> float:
    """Cold sequential read of ``file`` (evicted first), bytes per second."""
    _evict(file)
    fd = os.open(file, os.O_RDONLY)
    buf = bytearray(chunk)
    start, total = time.perf_counter(), 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - start)


def measure_child(path: Path, budget: str, out: Path) -> None:
    """Runs in a fresh process: the streamed validation, its record and wall time into ``out``."""
    from mlaq.progress import PlainProgress
    from mlaq.validate.config import ValidateConfig
    from mlaq.validate.shape import RunShape
    from mlaq.validate.sources.stream import StreamSource
    from mlaq.validate.stream import StreamConfig

    torch.set_num_threads(1)
    shape = RunShape(
        eval_text=path / "heldout.txt", context_len=RUN["context_len"], windows=RUN["windows"], prompt_len=64
    )
    cfg = ValidateConfig(model=path, shape=shape, schemes=RUN["schemes"], flip_rows=RUN["flip_rows"])
    start = time.perf_counter()
    stream = StreamSource(cfg, StreamConfig.parse(budget), noise_floor=None)
    record = stream.measure(PlainProgress("validate --stream"))
    wall = time.perf_counter() - start
    use = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "wall_seconds": wall,
        "cpu_seconds": use.ru_utime + use.ru_stime,
        "stream": record.config["stream"],
    }
    out.write_text(json.dumps(result))


def run_one(path: Path, budget: str) -> dict:
    out = path / "bench-result.json"
    for f in path.glob("*.safetensors"):
        _evict(f)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(path),
        "--budget",
        budget,
        "--flip-rows",
        str(RUN["flip_rows"]),
    ]
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=str(Path.home() / ".cache" / "mlaq-bench"))
    parser.add_argument("--budget", default="2GiB")
    parser.add_argument("--formats", default="bf16,fp8")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="measure a checkpoint --keep left (no rewrite)")
    parser.add_argument("--layers", type=int, default=BENCH["layers"], help="main layers (smoke runs: fewer)")
    parser.add_argument(
        "--flip-rows",
        type=int,
        default=0,
        help="attention flip rows per window and layer (validate's default: 256)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    RUN["flip_rows"] = args.flip_rows
    if args.child:
        measure_child(Path(args.child), args.budget, Path(args.child) / "bench-result.json")
        return 0
    from bench_stream_report import project, report  # beside this script

    BENCH["layers"] = args.layers
    results = {}
    for fmt in args.formats.split(","):
        path = Path(args.dir) / f"deepseek-v3-shapes-{fmt}"
        if args.reuse and (path / "config.json").is_file():
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        else:
            shutil.rmtree(path, ignore_errors=True)
            start = time.perf_counter()
            size = write_checkpoint(path, fmt)
            took = time.perf_counter() - start
            print(f"{fmt}: wrote {size / 1e9:.2f} GB in {took:.0f} s to {path}", flush=True)
        disk = disk_read_speed(next(iter(sorted(path.glob("model-0000[2-9]*.safetensors")))))
        print(f"{fmt}: cold sequential read {disk / 1e9:.2f} GB/s", flush=True)
        results[fmt] = {
            "checkpoint_bytes": size,
            "disk_read_bytes_per_s": disk,
            "main_layers": BENCH["layers"],
            **run_one(path, args.budget),
        }
        print(json.dumps(results[fmt]), flush=True)
        if not args.keep:
            shutil.rmtree(path)
    print(report(results, args.budget, RUN, BENCH))
    print(project(results, RUN, BENCH, DEEPSEEK_V3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
