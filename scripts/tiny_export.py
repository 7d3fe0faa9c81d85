"""Write mlaq-tiny as a Hugging Face DeepSeek-V3 checkpoint (MTP layer included) and read it back."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_model import TinyWithMtp
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _state_dict_with_mtp(model: TinyWithMtp) -> dict[str, torch.Tensor]:
    """All weights under Hugging Face DeepSeek-V3 names; MTP = model.layers.{num_hidden_layers}.*.

    The decoder layer goes through transformers' own save path (a model with one more layer), so its
    routed experts get the checkpoint layout (experts.{e}.{gate,up,down}_proj.weight) like the main layers.
    """
    cfg = model.lm.config
    n = cfg.num_hidden_layers
    big_cfg = copy.deepcopy(cfg)
    big_cfg.num_hidden_layers = n + 1
    big = DeepseekV3ForCausalLM(big_cfg)
    big.model.layers[n].load_state_dict(model.mtp.layer.state_dict())
    own = {k: v for k, v in model.lm.state_dict().items()}
    missing, unexpected = big.load_state_dict(own, strict=False)
    if unexpected or any(not k.startswith(f"model.layers.{n}.") for k in missing):
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    with tempfile.TemporaryDirectory() as tmp:
        big.save_pretrained(tmp)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    mtp_sd = model.mtp.state_dict()
    for name in MTP_EXTRA:
        tensors[f"model.layers.{n}.{name}"] = mtp_sd[name]
    out = {}
    for k, v in tensors.items():
        # DeepSeek-V3 checkpoints keep the router correction bias in fp32; everything else is bf16.
        dtype = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        out[k] = v.detach().to(dtype).contiguous()
    return out


def export(model: TinyWithMtp, tok: Tokenizer, tok_cfg: dict, out_dir: Path) -> None:
    """Write config, bf16 weights, tokenizer and generation config to out_dir (replaced atomically)."""
    out_dir = Path(out_dir)
    stage = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    save_file(_state_dict_with_mtp(model), str(stage / "model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(model.lm.config)
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
