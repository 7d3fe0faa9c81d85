"""Write mlaq-tiny as a Hugging Face DeepSeek-V3 checkpoint (MTP layer included) and read it back
(load_tiny: through transformers, the independent implementation used for evaluation)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_model import TinyWithMtp
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def to_checkpoint_dtypes(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 everywhere except the router correction bias, kept fp32 as in DeepSeek-V3's checkpoints."""
    out = {}
    for k, v in tensors.items():
        dtype = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        out[k] = v.detach().to(dtype).contiguous()
    return out


def export(
    tensors: dict[str, torch.Tensor], config: DeepseekV3Config, tok: Tokenizer, tok_cfg: dict, out_dir: Path
) -> None:
    """Write config, bf16 weights (Hugging Face names, MTP at model.layers.{n}), tokenizer and generation
    config to out_dir; the directory is replaced atomically (a partial export never replaces a good one)."""
    out_dir = Path(out_dir)
    stage = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    save_file(to_checkpoint_dtypes(tensors), str(stage / "model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(config)
    cfg.dtype = torch.bfloat16
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(stage)
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, do_sample=False
    ).save_pretrained(stage)
    tok.save(str(stage / "tokenizer.json"))
    (stage / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    keep = (
        [p for p in out_dir.glob("*") if p.name in ("README.md", "heldout.txt")] if out_dir.exists() else []
    )
    for p in keep:
        shutil.copy2(p, stage / p.name)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    stage.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_tiny(asset_dir: Path) -> TinyWithMtp:
    """Main model via transformers' from_pretrained, MTP layer from the same file; fp32, eval mode."""
    asset_dir = Path(asset_dir)
    cfg = DeepseekV3Config.from_pretrained(asset_dir)
    model = TinyWithMtp(cfg)
    model.lm = DeepseekV3ForCausalLM.from_pretrained(asset_dir, dtype=torch.float32)
    n = cfg.num_hidden_layers
    prefix = f"model.layers.{n}."
    sd: dict[str, torch.Tensor] = {}
    with safe_open(str(asset_dir / "model.safetensors"), "pt") as f:
        raw = {k[len(prefix) :]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    experts = cfg.n_routed_experts
    for k, v in raw.items():
        if k in MTP_EXTRA:
            sd[k] = v
        elif not k.startswith("mlp.experts."):
            sd["layer." + k] = v
    # Checkpoint layout experts.{e}.{gate,up,down}_proj -> transformers' fused (E, 2I, H) / (E, H, I).
    gate_up = [
        torch.cat([raw[f"mlp.experts.{e}.gate_proj.weight"], raw[f"mlp.experts.{e}.up_proj.weight"]])
        for e in range(experts)
    ]
    sd["layer.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    sd["layer.mlp.experts.down_proj"] = torch.stack(
        [raw[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
    )
    model.mtp.load_state_dict(sd, strict=True)
    return model.eval()
