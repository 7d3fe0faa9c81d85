"""scripts/tiny_lean.py (the fast module mlaq-tiny is trained with) computes transformers' DeepSeek-V3.

The lean module is exported with scripts/tiny_export.py and read back by transformers'
DeepseekV3ForCausalLM (main model) and by transformers' own decoder layer (MTP layer): logits must agree
in fp32, with a random router correction bias so that group-limited routing is exercised.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import SRC

pytest.importorskip("transformers")
sys.path.insert(0, str(SRC.parent / "scripts"))

from tiny_data import tokenizer_config, train_tokenizer
from tiny_export import export, load_tiny
from tiny_lean import LeanTiny
from tiny_model import TinyGeometry, build_config, yarn_parameters

GEO = TinyGeometry(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20], 300)
    cfg = build_config(GEO, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    lean = LeanTiny(cfg.to_dict()).eval()
    with torch.no_grad():
        for moe in lean.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.1)  # make the biased choice differ from the scores
    out = tmp_path_factory.mktemp("lean") / "ckpt"
    export(lean.checkpoint_tensors(), cfg, tok, tokenizer_config(64), out)
    lean.load_checkpoint_tensors(  # the exported (bf16-rounded) weights, back into the lean module
        {k: v.float() for k, v in load_file(out / "model.safetensors").items()}
    )
    return lean, out


def test_lean_module_matches_transformers(exported):
    lean, out = exported
    ref = load_tiny(out)  # transformers' DeepseekV3ForCausalLM + its decoder layer as the MTP layer
    ids = torch.randint(3, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a_main, a_mtp, a_ce, a_mce = lean(ids)
        b_main, b_mtp, b_ce, b_mce = ref(ids)
    scale = float(b_main.abs().max())
    assert float((a_main - b_main).abs().max()) <= 1e-5 * scale
    assert float((a_mtp - b_mtp).abs().max()) <= 1e-5 * float(b_mtp.abs().max())
    assert abs(float(a_ce - b_ce)) < 1e-5 and abs(float(a_mce - b_mce)) < 1e-5


def test_yarn_lean_module_matches_transformers(tmp_path):
    """DeepSeek's YaRN (factor 4 over a 64-token original context, mscale = mscale_all_dim = 1): the lean
    module's rope and softmax scale (through mlaq's Rope / MLAConfig) give transformers' logits past the
    original context, where the blended frequencies matter."""
    geo = TinyGeometry(**{**GEO.__dict__, "max_position_embeddings": 256})
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], 300)
    cfg = build_config(geo, bos_token_id=0, eos_token_id=1, rope_parameters=yarn_parameters(4, 64))
    torch.manual_seed(0)
    lean = LeanTiny(cfg.to_dict()).eval()
    assert lean.model.layers[0].self_attn.scale == pytest.approx(96**-0.5 * (0.1 * 1.3862944 + 1) ** 2)
    export(lean.checkpoint_tensors(), cfg, tok, tokenizer_config(256), tmp_path / "ckpt")
    lean.load_checkpoint_tensors(
        {k: v.float() for k, v in load_file(tmp_path / "ckpt" / "model.safetensors").items()}
    )
    ref = load_tiny(tmp_path / "ckpt")
    ids = torch.randint(3, 300, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a_main, a_mtp, _, _ = lean(ids)
        b_main, b_mtp, _, _ = ref(ids)
    assert float((a_main - b_main).abs().max()) <= 1e-5 * float(b_main.abs().max())
    assert float((a_mtp - b_mtp).abs().max()) <= 1e-5 * float(b_mtp.abs().max())


def test_checkpoint_names_round_trip(exported):
    lean, _ = exported
    tensors = lean.checkpoint_tensors()
    n = GEO.num_hidden_layers
    assert f"model.layers.{n}.eh_proj.weight" in tensors  # MTP layer at index num_hidden_layers
    assert f"model.layers.1.mlp.experts.{GEO.n_routed_experts - 1}.down_proj.weight" in tensors
    assert not any(".w_gate" in k or ".w_up" in k or ".w_down" in k for k in tensors)
    other = LeanTiny(lean.config)
    other.load_checkpoint_tensors(tensors)
    assert all(
        torch.equal(a, b)
        for a, b in zip(other.state_dict().values(), lean.state_dict().values(), strict=True)
    )
    with pytest.raises(KeyError, match="not used"):
        other.load_checkpoint_tensors({**tensors, "model.extra.weight": torch.zeros(1)})


def test_balance_loss_is_minimal_when_balanced():
    cfg = build_config(GEO, bos_token_id=0, eos_token_id=1).to_dict()
    moe = LeanTiny(cfg).moe_layers()[0].train()
    moe.balance_alpha = 1.0
    e, k = moe.e, moe.k
    idx = torch.arange(e).repeat(4).view(-1, k)  # every expert equally often
    logits = torch.zeros(idx.shape[0], e)  # equal affinities: P_i = 1/E
    assert float(moe.balance_loss(logits, idx, 1)) == pytest.approx(1.0)  # sum_i f_i P_i = E * 1 * 1/E
    skew = torch.zeros_like(idx)  # every slot to expert 0, which also has the highest affinity
    favour0 = logits.clone()
    favour0[:, 0] = 4.0
    p0 = torch.tensor(4.0).sigmoid() / (torch.tensor(4.0).sigmoid() + (e - 1) * 0.5)
    assert float(moe.balance_loss(favour0, skew, 1)) == pytest.approx(e * float(p0), rel=1e-6)  # f_0 = E
    assert float(moe.balance_loss(favour0, skew, 1)) > 1.5  # above the balanced value 1
    moe.eval()
    assert float(moe.balance_loss(favour0, skew, 1)) == 0.0  # only while training


def test_training_script_smoke(tmp_path):
    """scripts/train_tiny.py end to end on a toy corpus (eager, 3 steps): it exports a checkpoint that
    mlaq loads, with the held-out file and the MTP layer, and never trains on the held-out module."""
    from train_tiny import main

    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    for i in range(4):
        (corpus / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1\n" * 30)
    (corpus / "pkg" / "__init__.py").write_text("class Held:\n    pass\n" * 20)
    out = tmp_path / "out"
    main(["--corpus", str(corpus), "--heldout", "pkg", "--out", str(out), "--run-dir", str(tmp_path / "run"),
          "--vocab", "300", "--seq", "64", "--batch", "2", "--steps", "3", "--warmup", "1", "--tiny-geometry",
          "--no-compile", "--threads", "1"])  # fmt: skip
    assert (out / "heldout.txt").read_text().startswith("# file: pkg/__init__.py")
    run = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert run["train_files"] == 4 and run["heldout_files"] == ["pkg/__init__.py"] and run["steps_done"] == 3
    from mlaq.model import load_model

    model = load_model(out, dtype=torch.float32)
    assert model.num_mtp_layers == 1
