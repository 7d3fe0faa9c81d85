"""A lean training module for mlaq-tiny: DeepSeek-V3 (MLA + sigmoid-routed MoE) + one MTP layer.

transformers' DeepseekV3ForCausalLM is the reference, but it trains at a few hundred tokens/s on two CPU
cores (per-expert dispatch and fp32 everywhere). This module computes the same function with fewer,
larger ops: stacked expert weights with one sort-based dispatch per layer, SDPA, and bf16 autocast for the
matmuls (AMX). Parameter names are the checkpoint's (`model.layers.{i}.self_attn.kv_b_proj.weight`, ...)
except the routed experts, stored stacked and split on export (`checkpoint_tensors`).
Equivalence with transformers is checked by scripts/tiny_eval.py (and tests/test_tiny_lean.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlaq.model.layers.mla_config import MLAConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepseekV3RMSNorm: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def lin(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


def rope_tables(mla: MLAConfig, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (seq, R) as transformers lays them out (cat(half, half)), from mlaq's own Rope: plain RoPE,
    or DeepSeek's YaRN (blended frequencies, cos/sin times mscale / mscale_all_dim's ratio)."""
    cos, sin = mla.rope.cos_sin(torch.arange(seq))  # (seq, R/2), float32
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_interleave for one tensor (..., T, d): de-interleave, rotate_half."""
    *lead, t, d = x.shape
    x = x.reshape(*lead, t, d // 2, 2).transpose(-1, -2).reshape(*lead, t, d)
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class Attention(nn.Module):
    """MLA (naive form: W_UK/W_UV applied to every cached latent; what training wants)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        h, self.nh = c["hidden_size"], c["num_attention_heads"]
        self.nope, self.rope, self.v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.lora, qk = c["kv_lora_rank"], self.nope + self.rope
        # q_a / kv_a layernorm eps: transformers hard-codes 1e-6 (not rms_norm_eps) for these two
        self.q_a_proj, self.q_a_layernorm = lin(h, c["q_lora_rank"]), Norm(c["q_lora_rank"], 1e-6)
        self.q_b_proj = lin(c["q_lora_rank"], self.nh * qk)
        self.kv_a_proj_with_mqa, self.kv_a_layernorm = lin(h, self.lora + self.rope), Norm(self.lora, 1e-6)
        self.kv_b_proj = lin(self.lora, self.nh * (self.nope + self.v))
        self.o_proj = lin(self.nh * self.v, h)
        self.scale = MLAConfig.from_hf(c).softmax_scale  # 1/sqrt(qk), times YaRN's mscale_all_dim^2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # x: (B, T, H)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.nh, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)  # (B, nh, T, .)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(ckv)).view(b, t, self.nh, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v], dim=-1)
        q_pe = rope_interleaved(q_pe, cos, sin)
        k_pe = rope_interleaved(k_pe.unsqueeze(1), cos, sin).expand(b, self.nh, t, self.rope)
        qq = torch.cat([q_nope, q_pe], dim=-1)
        kk = torch.cat([k_nope, k_pe], dim=-1)
        # CPU flash attention needs equal head dims: pad V with zeros to qk and drop the padding after.
        vv = F.pad(v, (0, qq.shape[-1] - self.v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=self.scale)[..., : self.v]
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.v))


class Mlp(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = lin(h, inter), lin(h, inter), lin(inter, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """DeepseekV3TopkRouter's weights: router matrix (fp32 logits) and the noaux_tc correction bias."""

    def __init__(self, h: int, e: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(e, h))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))


@torch.compiler.disable  # data-dependent sizes: torch.compile would recompile for every new count
def run_experts(xs: torch.Tensor, load: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor):
    """xs: routed slots grouped by expert, load[e] slots each -> SwiGLU expert outputs, same order."""
    outs, start = [], 0
    for e, c in enumerate(load.tolist()):
        xe = xs[start : start + c]
        outs.append((F.silu(xe @ wg[e].t()) * (xe @ wu[e].t())) @ wd[e].t())
        start += c
    return torch.cat(outs)


class Moe(nn.Module):
    """Sigmoid routing, group-limited top-k on score + bias, weights from the unbiased score,
    normalised and scaled; routed experts stacked (E, I, H) and dispatched by one sort; a shared expert."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        h, i, e = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        self.e, self.k, self.groups, self.topk_group = (
            e,
            c["num_experts_per_tok"],
            c["n_group"],
            c["topk_group"],
        )
        self.scaling, self.norm = c["routed_scaling_factor"], c["norm_topk_prob"]
        self.gate = Gate(h, e)
        self.w_gate = nn.Parameter(torch.empty(e, i, h))
        self.w_up = nn.Parameter(torch.empty(e, i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = Mlp(h, i * c["n_shared_experts"])
        self.balance_alpha = 0.0  # weight of the sequence-wise balance loss (set by the trainer)
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None  # (expert loads (E,), balance loss)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, H) -> (top-k indices (N, k), weights (N, k), router logits (N, E)); transformers' routing."""
        with torch.autocast("cpu", enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid()
        choice = scores.detach() + self.gate.e_score_correction_bias
        n = choice.shape[0]
        group = choice.view(n, self.groups, -1).topk(2, dim=-1)[0].sum(-1)
        gidx = group.topk(self.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(group).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(n, self.groups, self.e // self.groups).reshape(n, -1)
        idx = choice.masked_fill(~smask.bool(), 0.0).topk(self.k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling, logits

    def balance_loss(self, logits: torch.Tensor, idx: torch.Tensor, seqs: int) -> torch.Tensor:
        """DeepSeek-V3's complementary sequence-wise balance loss (eq. 17-20), mean over sequences:
        alpha * sum_i f_i P_i with f_i = E/(k T) * (slots of expert i), P_i = mean normalised affinity."""
        if not self.balance_alpha or not self.training:
            return logits.new_zeros(())
        s = logits.sigmoid().view(seqs, -1, self.e)
        p = (s / s.sum(-1, keepdim=True)).mean(1)  # (B, E)
        hits = F.one_hot(idx.view(seqs, -1), self.e).sum(1).float()  # (B, E)
        f = hits * self.e / (idx.shape[1] * s.shape[1])
        return self.balance_alpha * (f * p).sum(-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        idx, w, logits = self.route(flat)
        order = idx.flatten().argsort(stable=True)
        tok = order // self.k  # token of each routed slot, grouped by expert
        load = torch.bincount(idx.flatten(), minlength=self.e)
        self.stats = (load, self.balance_loss(logits, idx, shape[0]))
        ws = w.flatten()[order].unsqueeze(-1)
        routed = run_experts(flat[tok], load, self.w_gate, self.w_up, self.w_down)
        routed = routed * ws.to(routed.dtype)
        out = torch.zeros_like(flat, dtype=routed.dtype).index_add_(0, tok, routed)
        return (out.to(x.dtype) + self.shared_experts(flat)).reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c: dict, moe: bool) -> None:
        super().__init__()
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm, self.post_attention_layernorm = Norm(h, eps), Norm(h, eps)
        self.self_attn = Attention(c)
        self.mlp = Moe(c) if moe else Mlp(h, c["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    def __init__(self, h: int, eps: float) -> None:
        super().__init__()
        self.norm = Norm(h, eps)


class MtpLayer(DecoderLayer):
    """DeepSeek-V3 MTP module: eh_proj(concat(enorm(embed(x[t+1])), hnorm(h[t]))) -> decoder layer."""

    def __init__(self, c: dict) -> None:
        super().__init__(c, moe=True)
        h, eps = c["hidden_size"], c["rms_norm_eps"]
        self.enorm, self.hnorm, self.eh_proj = Norm(h, eps), Norm(h, eps), lin(2 * h, h)
        self.shared_head = SharedHead(h, eps)


class LeanTiny(nn.Module):
    """Main model (model.embed_tokens, model.layers[0..n-1], model.norm, lm_head) + MTP at model.layers[n]."""

    def __init__(self, config: dict, positions: int | None = None) -> None:
        """positions: rows of the RoPE table, max_position_embeddings by default (more to train past the
        context: the same frequencies, continued)."""
        super().__init__()
        c = config
        self.config, self.n = dict(c), c["num_hidden_layers"]
        h, dense = c["hidden_size"], c["first_k_dense_replace"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], h)
        layers = [DecoderLayer(c, moe=i >= dense) for i in range(self.n)]
        self.model.layers = nn.ModuleList([*layers, MtpLayer(c)])
        self.model.norm = Norm(h, c["rms_norm_eps"])
        self.lm_head = lin(h, c["vocab_size"])
        cos, sin = rope_tables(MLAConfig.from_hf(c), max(positions or 0, c["max_position_embeddings"]))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters(c.get("initializer_range", 0.02))

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """transformers' DeepSeek-V3 init: N(0, std) for matrices, ones for norms, zero bias."""
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            elif name.endswith("weight"):
                p.fill_(1.0)
        for m in self.modules():
            if isinstance(m, Gate):
                m.e_score_correction_bias.zero_()

    def moe_layers(self) -> list[Moe]:
        """Every MoE block (main layers, then the MTP layer)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, Moe)]

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> final hidden states after model.norm (B, T, H)."""
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers[: self.n]:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """MTP at position t: h[t] (after model.norm) and x[t+1] -> shared_head.norm output (B, T, H)."""
        mtp = self.model.layers[self.n]
        t = hidden.shape[1]
        e = mtp.enorm(self.model.embed_tokens(next_ids))
        x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden)], dim=-1))
        x = DecoderLayer.forward(mtp, x, self.cos[:t], self.sin[:t])
        return mtp.shared_head.norm(x)

    def forward(
        self, tokens: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens (B, T+1) -> (main logits (B,T,V), MTP logits (B,T-1,V), main CE, MTP CE).

        weights (B, T), optional: per-target weights of the main CE (a weighted mean); the MTP CE is plain.
        """
        hidden = self.hidden(tokens[:, :-1])
        logits = self.lm_head(hidden)
        if weights is None:
            main_ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        else:
            ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none")
            w = weights.flatten().float()
            main_ce = (ce * w).sum() / w.sum()
        mlog = self.lm_head(self.mtp_hidden(hidden[:, :-1], tokens[:, 1:-1]))
        mtp_ce = F.cross_entropy(mlog.flatten(0, 1).float(), tokens[:, 2:].flatten())
        return logits, mlog, main_ce, mtp_ce

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Hugging Face DeepSeek-V3 names; routed experts split to experts.{e}.{gate,up,down}_proj.weight."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict().items():
            names = _checkpoint_names(name, t)
            out.update(zip(names, t, strict=True) if names else {name: t})
        return out

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of checkpoint_tensors (strict: every tensor used, every parameter filled)."""
        left = dict(tensors)
        for name, t in self.state_dict().items():
            names = _checkpoint_names(name, t)
            t.copy_(torch.stack([left.pop(n) for n in names]) if names else left.pop(name))
        if left:
            raise KeyError(f"checkpoint tensors not used by LeanTiny: {sorted(left)[:5]}")


_STACKED = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def _checkpoint_names(name: str, t: torch.Tensor) -> list[str]:
    """The per-expert checkpoint names of a stacked expert tensor (E, ., .), in expert order; [] otherwise."""
    prefix, _, last = name.rpartition(".")
    if last not in _STACKED or not prefix.endswith(".mlp"):
        return []
    return [f"{prefix}.experts.{e}.{_STACKED[last]}.weight" for e in range(t.shape[0])]
