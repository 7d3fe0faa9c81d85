"""A Quark MXFP4 checkpoint whose config asks for dynamic MXFP4 input tensors (W4A4) is refused with one
clear line (mlaq runs checkpoint linears weights-only); `mlaq explain` still reads it."""

from __future__ import annotations

from mlaq.cli import main
from model_helpers import edit_config, hf_checkpoint
from quant_helpers import quantize_checkpoint

MX = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}


def test_w4a4_quark_is_refused_and_explained(tmp_path, capsys):
    _, path = hf_checkpoint("deepseek_v3", tmp_path, q_lora_rank=64, num_hidden_layers=2)
    (path / "heldout.txt").write_text("x\n")
    quantize_checkpoint(path, "quark_mxfp4", skip=("self_attn",))
    cfg = edit_config(path)  # read it back
    qc = cfg["quantization_config"]
    qc["global_quant_config"]["input_tensors"] = {**MX, "is_dynamic": True}
    edit_config(path, quantization_config=qc)
    before = sorted(p.name for p in path.iterdir())
    capsys.readouterr()  # drop the checkpoint writer's progress output
    rc = main(["generate", str(path), "--prompt-token-ids", "1,2", "--max-tokens", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "global_quant_config quantizes input_tensors dynamically to MXFP4 (W4A4)" in err
    assert "refuses to load it" in err
    assert sorted(p.name for p in path.iterdir()) == before
    assert main(["explain", str(path)]) == 0
    assert "W4A4 MXFP4" in capsys.readouterr().out
