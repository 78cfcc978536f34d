"""Golden gradient cases for the backward pass: PyTorch float64 autograd through an explicit
attention (RoPE, GQA, masks, softcap, ALiBi, custom closures, learnable parameters and sinks, and
MLA in its expanded form), from inputs stored in each case's dtype. Writes tests/fixtures/gradients/<case>.safetensors (q, k, v,
dout as stored, or MLA's q_nope, q_pe, c_kv, k_pe, w_kv_b, dout; their gradients, out and lse in
float64) and manifest.json (the spec text, position offset, the input and gradient names of MLA
cases, and for 16-bit cases the error of the same autograd run in that dtype: what PyTorch itself
misses by).

Run from the repository root with a PyTorch venv: $(scripts/setup-torch.sh) scripts/make_grad_fixtures.py
"""
import json, math, os, torch
from safetensors.torch import save_file

OUT = "tests/fixtures/gradients"
DT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def rope(x, pos, base, layout):
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    if layout == "half":
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def xpos(x, pos, center, base, scale_base, gamma, downscale):
    """xPos as the paper's code (torchscale) writes it: interleaved RoPE whose pair i is also
    scaled by zeta_i^(t / scale_base) (queries) or its inverse (keys, `downscale`), t counted
    from `center`, as torchscale counts from the middle of the sequence (the origin cancels in
    every score)."""
    d = x.shape[-1]
    zeta = (torch.arange(0, d, 2, dtype=torch.float64) + gamma * d) / ((1 + gamma) * d)
    t = pos.to(torch.float64) - center
    scale = zeta[None, :] ** (t[:, None] / scale_base)
    if downscale:
        scale = 1 / scale
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = (torch.cos(ang) * scale).repeat_interleave(2, dim=-1).to(x.dtype)
    sin = (torch.sin(ang) * scale).repeat_interleave(2, dim=-1).to(x.dtype)
    # rotate_every_two: (x0, x1) -> (-x1, x0) per pair.
    rot = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return x * cos + rot * sin


def attention(c, q, k, v, p0, learned=None):
    learned = learned or {}
    B, H, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    qpos = torch.arange(Sq) + p0 + Skv - Sq
    kpos = torch.arange(Skv) + p0
    if c.get("rope"):
        q, k = rope(q, qpos, c["rope"]["base"], c["rope"]["layout"]), rope(k, kpos, c["rope"]["base"], c["rope"]["layout"])
    if c.get("xpos"):
        x, center = c["xpos"], (Skv + p0) // 2
        q = xpos(q, qpos, center, x["base"], x["scale_base"], x["gamma"], False)
        k = xpos(k, kpos, center, x["base"], x["scale_base"], x["gamma"], True)
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = (q @ k.transpose(-1, -2)) * c["scale"]
    if c.get("softcap"):
        s = c["softcap"] * torch.tanh(s / c["softcap"])
    dist = (kpos[None, :] - qpos[:, None]).to(s.dtype)
    if c.get("alibi"):
        slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], dtype=s.dtype)
        s = s + slopes[None, :, None, None] * dist
    heads = torch.arange(H)[None, :, None, None]
    if c.get("score_mod"):
        s = c["score_mod"](s, heads, qpos[:, None], kpos[None, :])
    if c.get("learned_mod"):
        s = c["learned_mod"](s, heads, qpos[:, None], kpos[None, :], learned)
    keep = torch.ones(Sq, Skv, dtype=torch.bool)
    mask = c.get("mask", "none")
    if mask == "causal":
        keep &= kpos[None, :] <= qpos[:, None]
    elif mask == "top_left":
        keep &= torch.arange(Skv)[None, :] <= torch.arange(Sq)[:, None]
    elif mask.startswith("window"):
        w = int(mask.split(":")[1])
        keep &= (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] - kpos[None, :] < w)
    if c.get("mask_mod"):
        keep &= c["mask_mod"](qpos[:, None], kpos[None, :])
    keep = keep[None, None].expand(B, H, Sq, Skv)
    if c.get("sigmoid") is not None:
        # Sigmoid attention: each kept key weighs sigmoid(s + bias) on its own; lse is the log
        # of the weights' sum (-inf for a row with none).
        w = torch.where(keep, torch.sigmoid(s + c["sigmoid"]), torch.zeros((), dtype=s.dtype))
        return w @ v, torch.log(w.sum(-1))
    if c.get("stick_breaking"):
        # Stick-breaking (Tan et al., 2024) as its paper writes it: log A_ij = log sigmoid(s_ij)
        # + sum over the kept keys l after j of log(1 - sigmoid(s_il)), a reversed cumulative
        # sum over the key axis; masked keys take no share and break nothing.
        zero = torch.zeros((), dtype=s.dtype)
        log_rest = torch.where(keep, torch.nn.functional.logsigmoid(-s), zero)
        after = torch.flip(torch.cumsum(torch.flip(log_rest, [-1]), -1), [-1]) - log_rest
        w = torch.where(keep, torch.exp(torch.nn.functional.logsigmoid(s) + after), zero)
        return w @ v, torch.log(w.sum(-1))
    if "sinks" in learned:
        # gpt-oss: the sink is one more logit per head, with no value; its column is dropped.
        s = torch.where(keep, s, torch.tensor(float("-inf"), dtype=s.dtype))
        sink = learned["sinks"].view(1, H, 1, 1).expand(B, H, Sq, 1)
        full = torch.cat([s, sink], dim=-1)
        return torch.softmax(full, dim=-1)[..., :-1] @ v, torch.logsumexp(full, dim=-1)
    any_kept = keep.any(-1, keepdim=True)
    s = torch.where(keep, s, torch.tensor(float("-inf"), dtype=s.dtype))
    # Fully masked rows: out 0, lse -inf, no gradient (softmax of a row of zeros, then zeroed).
    s_safe = torch.where(any_kept, s, torch.zeros((), dtype=s.dtype))
    p = torch.where(any_kept, torch.softmax(s_safe, dim=-1), torch.zeros((), dtype=s.dtype))
    lse = torch.where(any_kept[..., 0], torch.logsumexp(s_safe, dim=-1), torch.tensor(float("-inf"), dtype=s.dtype))
    return p @ v, lse


def mla_attention(c, q_nope, q_pe, c_kv, k_pe, w_kv_b, p0):
    """MLA as the model defines it (DeepSeek layout): per head, k_nope = W_uk c_kv and
    v = W_uv c_kv; q = [q_nope | rope(q_pe)], k = [k_nope | rope(k_pe)] (k_pe shared)."""
    B, H, Sq, dn = q_nope.shape
    Skv, dv = c_kv.shape[1], c["dv"]
    qpos = torch.arange(Sq) + p0 + Skv - Sq
    kpos = torch.arange(Skv) + p0
    w = w_kv_b.view(H, dn + dv, -1)
    k_nope = torch.einsum("hnr,bjr->bhjn", w[:, :dn], c_kv)
    v = torch.einsum("hmr,bjr->bhjm", w[:, dn:], c_kv)
    rq, rk = q_pe, k_pe[:, None]
    if c.get("rope"):
        rq = rope(q_pe, qpos, c["rope"]["base"], c["rope"]["layout"])
        rk = rope(k_pe[:, None], kpos, c["rope"]["base"], c["rope"]["layout"])
    q = torch.cat([q_nope, rq], dim=-1)
    k = torch.cat([k_nope, rk.expand(B, H, Skv, rk.shape[-1])], dim=-1)
    inner = {key: val for key, val in c.items() if key != "rope"}
    return attention(inner, q, k, v, p0)


def mla_grads(c, tensors, dtype, p0):
    xs = [t.to(dtype).detach().requires_grad_(i < 5) for i, t in enumerate(tensors)]
    out, lse = mla_attention(c, *xs[:5], p0)
    (out * xs[5]).sum().backward()
    return out.detach(), lse.detach(), [x.grad for x in xs[:5]]


MLA_INPUTS = ["q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b"]


def grads(c, tensors, dtype, p0, learned=None):
    q, k, v, dout = [t.to(dtype).detach().requires_grad_(i < 3) for i, t in enumerate(tensors)]
    params = {n: t.to(dtype).detach().requires_grad_(True) for n, t in (learned or {}).items()}
    out, lse = attention(c, q, k, v, p0, params)
    (out * dout).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, {n: t.grad for n, t in params.items()}


CASES = {
    "mha_causal_f32": dict(B=1, H=4, Hkv=4, Sq=65, Skv=65, D=64, dtype="f32", mask="causal",
                            spec="heads = 4, head_dim = 64, mask = causal"),
    "gqa_rope_offset_f32": dict(B=2, H=8, Hkv=2, Sq=33, Skv=70, D=64, dtype="f32", mask="causal", p0=5,
                                rope=dict(base=10000.0, layout="half"),
                                spec="heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope"),
    "softcap_alibi_f32": dict(B=1, H=4, Hkv=4, Sq=40, Skv=40, D=32, dtype="f32", mask="causal", softcap=2.0, alibi=True,
                              spec="heads = 4, head_dim = 32, mask = causal, softcap = 2.0, position = alibi"),
    "custom_closures_f32": dict(
        B=1, H=2, Hkv=1, Sq=24, Skv=30, D=32, dtype="f32",
        score_mod=lambda s, h, q, k: torch.tanh(s * 0.5) * 4.0 - 0.05 * (q - k).abs().to(s.dtype),
        mask_mod=lambda q, k: ((q + k) % 3 != 1) & (q != 10),
        spec="heads = 2, kv_heads = 1, head_dim = 32, score_mod = |s, b, h, q, k| (s * 0.5).tanh() * 4.0 "
             "- 0.05 * (q - k).abs() as f32, mask_mod = |b, h, q, k| (q + k) % 3 != 1 && q != 10"),
    "top_left_sq_gt_skv_f32": dict(B=1, H=2, Hkv=2, Sq=20, Skv=12, D=16, dtype="f32", mask="top_left",
                                   spec="heads = 2, head_dim = 16, mask = causal(top_left)"),
    "window_gqa_bf16": dict(B=1, H=4, Hkv=2, Sq=50, Skv=50, D=64, dtype="bf16", mask="window:16",
                            spec="heads = 4, kv_heads = 2, head_dim = 64, mask = sliding_window(16), dtype = bf16"),
    "rope_interleaved_f16": dict(B=1, H=2, Hkv=2, Sq=40, Skv=40, D=64, dtype="f16", mask="causal",
                                 rope=dict(base=500.0, layout="interleaved"),
                                 spec="heads = 2, head_dim = 64, mask = causal, dtype = f16, "
                                      "position = rope(base = 500.0, layout = interleaved)"),
}

# MLA cases (inputs q_nope, q_pe, c_kv, k_pe, w_kv_b; gradients d<input>), after the per-head
# ones so that those keep their random inputs.
MLA_CASES = {
    "mla_rope_causal_f32": dict(B=1, H=4, Sq=40, Skv=40, dn=32, dv=32, r=64, dr=16, dtype="f32",
                                mask="causal", rope=dict(base=10000.0, layout="half"),
                                spec="heads = 4, head_dim = 32, mask = causal, "
                                     "mla(latent_rank = 64, rope_dim = 16), position = rope"),
    "mla_softcap_offset_bf16": dict(B=2, H=2, Sq=9, Skv=30, dn=16, dv=16, r=32, dr=16, dtype="bf16",
                                    mask="causal", p0=3, softcap=4.0, rope=dict(base=10000.0, layout="half"),
                                    spec="heads = 2, head_dim = 16, mask = causal, softcap = 4.0, "
                                         "mla(latent_rank = 32, rope_dim = 16), position = rope, dtype = bf16"),
}

# Cases added later, drawn from a generator of their own so that every case above keeps its
# inputs.
LATER_CASES = {
    "softcap_alibi_gqa_f16": dict(B=1, H=8, Hkv=2, Sq=96, Skv=96, D=64, dtype="f16", mask="causal", p0=3,
                                  softcap=20.0, alibi=True,
                                  spec="heads = 8, kv_heads = 2, head_dim = 64, mask = causal, softcap = 20.0, "
                                       "position = alibi, dtype = f16"),
}


def per_head_case(name, c, g, manifest):
    c.setdefault("scale", 1 / math.sqrt(c["D"]))
    p0 = c.get("p0", 0)
    shapes = [(c["B"], c["H"], c["Sq"], c["D"]), (c["B"], c["Hkv"], c["Skv"], c["D"]),
              (c["B"], c["Hkv"], c["Skv"], c["D"]), (c["B"], c["H"], c["Sq"], c["D"])]
    stored = [torch.randn(*s, generator=g).to(DT[c["dtype"]]) for s in shapes]
    # Learnable tensors are f32 whatever the case's dtype (as attn takes them).
    learned = {n: init(g).to(torch.float32) for n, init in c.get("learned", {}).items()}
    out, lse, dq, dk, dv, dl = grads(c, stored, torch.float64, p0, learned)
    entry = {"spec": c["spec"], "position_offset": p0, "dtype": c["dtype"],
             "file": f"{name}.safetensors"}
    if learned:
        entry["learned"] = list(learned)
    if c["dtype"] != "f32":
        _, _, lq, lk, lv, ll = grads(c, stored, DT[c["dtype"]], p0, learned)
        pairs = [("dq", lq, dq), ("dk", lk, dk), ("dv", lv, dv)]
        pairs += [("d" + n, ll[n], dl[n]) for n in learned]
        entry["torch_lowp_grad_max_abs_err"] = {
            n: float((lo.to(torch.float64) - hi).abs().max()) for n, lo, hi in pairs}
    tensors = dict(zip(["q", "k", "v", "dout"], stored))
    tensors.update(dq=dq, dk=dk, dv=dv, out=out, lse=lse)
    tensors.update(learned)
    tensors.update({"d" + n: t for n, t in dl.items()})
    save_file({k: t.contiguous() for k, t in tensors.items()}, f"{OUT}/{name}.safetensors")
    manifest["cases"][name] = entry


# Learnable parameters and sinks, from a third generator. `learned` maps each tensor to how its
# values are drawn; `learned_mod` reads them.
LEARNED_CASES = {
    "learned_slopes_gqa_f32": dict(
        B=2, H=4, Hkv=2, Sq=40, Skv=48, D=32, dtype="f32", mask="causal", p0=2,
        learned=dict(slopes=lambda g: torch.rand(4, generator=g) * 0.5),
        learned_mod=lambda s, h, q, k, P: s + P["slopes"][h] * (k - q).to(s.dtype),
        spec="heads = 4, kv_heads = 2, head_dim = 32, mask = causal, params(slopes: [heads]), "
             "score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32"),
    "relative_bias_clamped_f32": dict(
        B=1, H=2, Hkv=2, Sq=60, Skv=60, D=32, dtype="f32", mask="causal",
        learned=dict(rel=lambda g: torch.randn(2, 32, generator=g)),
        learned_mod=lambda s, h, q, k, P: s + P["rel"][h, (q - k).clamp(0, 31)],
        spec="heads = 2, head_dim = 32, mask = causal, params(rel: [heads, 32]), "
             "score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 31), 0)]"),
    "head_temperature_f32": dict(
        B=1, H=4, Hkv=4, Sq=30, Skv=37, D=32, dtype="f32",
        learned=dict(temp=lambda g: 1.0 + 0.3 * torch.randn(4, generator=g)),
        learned_mod=lambda s, h, q, k, P: s * P["temp"][h],
        spec="heads = 4, head_dim = 32, params(temp: [heads]), score_mod = |s, b, h, q, k| s * temp[h]"),
    "sinks_window_gqa_f32": dict(
        B=1, H=4, Hkv=1, Sq=50, Skv=50, D=32, dtype="f32", mask="window:16",
        learned=dict(sinks=lambda g: torch.randn(4, generator=g)),
        spec="heads = 4, kv_heads = 1, head_dim = 32, mask = sliding_window(16), sinks = learned"),
    "sinks_causal_bf16": dict(
        B=1, H=4, Hkv=2, Sq=64, Skv=64, D=64, dtype="bf16", mask="causal",
        learned=dict(sinks=lambda g: torch.randn(4, generator=g)),
        spec="heads = 4, kv_heads = 2, head_dim = 64, mask = causal, sinks = learned, dtype = bf16"),
}


def fire(s, h, q, k, P):
    """FIRE's learned positional term (a two-unit MLP of the log-scaled distance), as the spec
    writes it with `let`; the distance is clamped at 0, which changes nothing on the kept
    (causal) pairs and keeps the masked ones finite."""
    c = P["c"][0].abs()
    d = (q - k).clamp(min=0).to(s.dtype)
    rel = torch.log(c * d + 1.0)
    norm = torch.log(c * torch.maximum(q.to(s.dtype), P["thr"][0].abs() + 1.0) + 1.0)
    x = rel / norm
    hidden = [torch.relu(P["w1"][h, u] * x + P["b1"][h, u]) for u in range(2)]
    return s + P["w2"][h, 0] * hidden[0] + P["w2"][h, 1] * hidden[1]


# The attention of recent papers (sigmoid attention; FIRE written with `let`), from a fourth
# generator.
PAPER_CASES = {
    "sigmoid_causal_gqa_f32": dict(
        B=2, H=4, Hkv=2, Sq=70, Skv=70, D=32, dtype="f32", mask="causal", sigmoid=-math.log(64),
        spec="heads = 4, kv_heads = 2, head_dim = 32, mask = causal, "
             "normalize = sigmoid(bias = -ln(64))"),
    "sigmoid_learned_slopes_window_f32": dict(
        B=1, H=4, Hkv=4, Sq=40, Skv=48, D=32, dtype="f32", mask="window:20", p0=3, sigmoid=-2.0,
        learned=dict(slopes=lambda g: torch.rand(4, generator=g) * 0.5),
        learned_mod=lambda s, h, q, k, P: s + P["slopes"][h] * (k - q).to(s.dtype),
        spec="heads = 4, head_dim = 32, mask = sliding_window(20), normalize = sigmoid(bias = -2.0), "
             "params(slopes: [heads]), score_mod = |s, b, h, q, k| s + slopes[h] * (k - q) as f32"),
    "sigmoid_rope_bf16": dict(
        B=1, H=2, Hkv=1, Sq=64, Skv=64, D=64, dtype="bf16", mask="causal", sigmoid=-3.0,
        rope=dict(base=10000.0, layout="half"),
        spec="heads = 2, kv_heads = 1, head_dim = 64, mask = causal, position = rope, dtype = bf16, "
             "normalize = sigmoid(bias = -3.0)"),
    "fire_lets_f32": dict(
        B=1, H=2, Hkv=2, Sq=50, Skv=50, D=32, dtype="f32", mask="causal",
        learned=dict(c=lambda g: 0.5 + torch.rand(1, generator=g),
                     thr=lambda g: 4.0 + torch.rand(1, generator=g),
                     w1=lambda g: torch.randn(2, 2, generator=g),
                     b1=lambda g: 0.5 * torch.randn(2, 2, generator=g),
                     w2=lambda g: torch.randn(2, 2, generator=g)),
        learned_mod=fire,
        spec="heads = 2, head_dim = 32, mask = causal, params(c: [1] = 1.0, thr: [1] = 8.0, "
             "w1: [heads, 2] = normal(0.5), b1: [heads, 2], w2: [heads, 2] = normal(0.5)), "
             "score_mod = |s, b, h, q, k| let rel = (c[0].abs() * (q - k) as f32 + 1.0).ln(); "
             "let norm = (c[0].abs() * max(q as f32, thr[0].abs() + 1.0) + 1.0).ln(); "
             "let x = rel / norm; "
             "s + w2[h, 0] * (w1[h, 0] * x + b1[h, 0]).max(0.0) + w2[h, 1] * (w1[h, 1] * x + b1[h, 1]).max(0.0)"),
    "xpos_causal_gqa_f32": dict(
        B=1, H=4, Hkv=2, Sq=48, Skv=64, D=32, dtype="f32", mask="causal", p0=7,
        xpos=dict(base=10000.0, scale_base=512.0, gamma=0.4),
        spec="heads = 4, kv_heads = 2, head_dim = 32, mask = causal, position = xpos"),
    "xpos_strong_decay_bf16": dict(
        B=2, H=2, Hkv=2, Sq=64, Skv=64, D=64, dtype="bf16", mask="causal",
        xpos=dict(base=500.0, scale_base=16.0, gamma=0.4),
        spec="heads = 2, head_dim = 64, mask = causal, dtype = bf16, "
             "position = xpos(base = 500.0, scale_base = 16.0)"),
    "stick_breaking_causal_gqa_f32": dict(
        B=1, H=4, Hkv=2, Sq=70, Skv=150, D=32, dtype="f32", mask="causal", p0=2, stick_breaking=True,
        spec="heads = 4, kv_heads = 2, head_dim = 32, mask = causal, normalize = stick_breaking"),
    "stick_breaking_window_softcap_bf16": dict(
        B=2, H=2, Hkv=1, Sq=80, Skv=80, D=64, dtype="bf16", mask="window:48", softcap=8.0,
        stick_breaking=True,
        spec="heads = 2, kv_heads = 1, head_dim = 64, mask = sliding_window(48), softcap = 8.0, "
             "dtype = bf16, normalize = stick_breaking"),
}


def differential_grads(c, tensors, dtype, p0, lam):
    """DIFF Transformer (Ye et al., 2024) in its official code's layout: 2H component query
    heads and 2Hkv key heads (GQA repeating the key heads over the query heads), values of Hkv
    heads repeated over the H differential heads; lambda = exp(q1 . k1) - exp(q2 . k2) + init;
    out_h = (A_2h - lambda A_2h+1) v. Returns out, the components' lse and the gradients."""
    q, k, v, dout = [t.to(dtype).detach().requires_grad_(i < 3) for i, t in enumerate(tensors)]
    vecs = {n: t.to(dtype).detach().requires_grad_(True) for n, t in lam.items()}
    lam_value = (torch.exp((vecs["lambda_q1"] * vecs["lambda_k1"]).sum())
                 - torch.exp((vecs["lambda_q2"] * vecs["lambda_k2"]).sum()) + c["lambda_init"])
    # Each value head given to both components of its heads: attention() then repeats the
    # 2Hkv value heads over the 2H query heads as it does the keys.
    both = v.repeat_interleave(2, dim=1)
    comp, lse = attention(c, q, k, both, p0)
    out = comp[:, 0::2] - lam_value * comp[:, 1::2]
    (out * dout).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, {n: t.grad for n, t in vecs.items()}


LAMBDA = ["lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"]

DIFFERENTIAL_CASES = {
    "differential_causal_gqa_rope_f32": dict(
        B=2, H=8, Hkv=4, Sq=48, Skv=60, D=32, Dv=64, dtype="f32", mask="causal", p0=3,
        rope=dict(base=10000.0, layout="half"), lambda_init=0.8,
        spec="heads = 8, kv_heads = 4, head_dim = 32, v_head_dim = 64, mask = causal, "
             "position = rope, differential = lambda"),
    "differential_window_bf16": dict(
        B=1, H=4, Hkv=2, Sq=64, Skv=64, D=64, Dv=128, dtype="bf16", mask="window:24",
        lambda_init=0.2,
        spec="heads = 4, kv_heads = 2, head_dim = 64, v_head_dim = 128, mask = sliding_window(24), "
             "dtype = bf16, differential = lambda(init = 0.2)"),
}


def differential_case(name, c, g, manifest):
    c.setdefault("scale", 1 / math.sqrt(c["D"]))
    p0 = c.get("p0", 0)
    B, H, Hkv, Sq, Skv, D, Dv = (c[n] for n in ["B", "H", "Hkv", "Sq", "Skv", "D", "Dv"])
    shapes = [(B, H, Sq, D), (B, Hkv, Skv, D), (B, Hkv // 2, Skv, Dv), (B, H // 2, Sq, Dv)]
    stored = [torch.randn(*s, generator=g).to(DT[c["dtype"]]) for s in shapes]
    # The paper draws lambda's vectors from N(0, 0.1); f32 whatever the case's dtype.
    lam = {n: 0.1 * torch.randn(D, generator=g) for n in LAMBDA}
    out, lse, dq, dk, dv, dl = differential_grads(c, stored, torch.float64, p0, lam)
    entry = {"spec": c["spec"], "position_offset": p0, "dtype": c["dtype"],
             "file": f"{name}.safetensors", "learned": LAMBDA}
    if c["dtype"] != "f32":
        _, _, lq, lk, lv, ll = differential_grads(c, stored, DT[c["dtype"]], p0, lam)
        pairs = [("dq", lq, dq), ("dk", lk, dk), ("dv", lv, dv)]
        pairs += [("d" + n, ll[n], dl[n]) for n in LAMBDA]
        entry["torch_lowp_grad_max_abs_err"] = {
            n: float((lo.to(torch.float64) - hi).abs().max()) for n, lo, hi in pairs}
    tensors = dict(zip(["q", "k", "v", "dout"], stored))
    tensors.update(dq=dq, dk=dk, dv=dv, out=out, lse=lse)
    tensors.update(lam)
    tensors.update({"d" + n: t for n, t in dl.items()})
    save_file({k: t.contiguous() for k, t in tensors.items()}, f"{OUT}/{name}.safetensors")
    manifest["cases"][name] = entry


def main():
    os.makedirs(OUT, exist_ok=True)
    g = torch.Generator().manual_seed(16)
    manifest = {"_about": __doc__.strip().splitlines()[0], "_torch": torch.__version__, "cases": {}}
    for name, c in CASES.items():
        per_head_case(name, c, g, manifest)
    for name, c in MLA_CASES.items():
        c.setdefault("scale", 1 / math.sqrt(c["dn"] + c["dr"]))
        p0 = c.get("p0", 0)
        B, H, Sq, Skv = c["B"], c["H"], c["Sq"], c["Skv"]
        shapes = [(B, H, Sq, c["dn"]), (B, H, Sq, c["dr"]), (B, Skv, c["r"]), (B, Skv, c["dr"]),
                  (H * (c["dn"] + c["dv"]), c["r"]), (B, H, Sq, c["dv"])]
        # The latent projection scaled as a trained one is (its rows are O(1) dot products).
        stored = [torch.randn(*s, generator=g) for s in shapes]
        stored[4] = stored[4] / math.sqrt(c["r"])
        stored = [t.to(DT[c["dtype"]]) for t in stored]
        out, lse, gs = mla_grads(c, stored, torch.float64, p0)
        entry = {"spec": c["spec"], "position_offset": p0, "dtype": c["dtype"],
                 "file": f"{name}.safetensors", "inputs": MLA_INPUTS + ["dout"],
                 "grads": ["d" + n for n in MLA_INPUTS]}
        if c["dtype"] != "f32":
            _, _, lows = mla_grads(c, stored, DT[c["dtype"]], p0)
            entry["torch_lowp_grad_max_abs_err"] = {
                "d" + n: float((lo.to(torch.float64) - hi).abs().max()) for n, lo, hi in
                zip(MLA_INPUTS, lows, gs)}
        tensors = dict(zip(MLA_INPUTS + ["dout"], stored))
        tensors.update({"d" + n: t for n, t in zip(MLA_INPUTS, gs)})
        tensors.update(out=out, lse=lse)
        save_file({k: t.contiguous() for k, t in tensors.items()}, f"{OUT}/{name}.safetensors")
        manifest["cases"][name] = entry
    later = torch.Generator().manual_seed(17)
    for name, c in LATER_CASES.items():
        per_head_case(name, c, later, manifest)
    learned = torch.Generator().manual_seed(18)
    for name, c in LEARNED_CASES.items():
        per_head_case(name, c, learned, manifest)
    papers = torch.Generator().manual_seed(19)
    for name, c in PAPER_CASES.items():
        per_head_case(name, c, papers, manifest)
    differential = torch.Generator().manual_seed(20)
    for name, c in DIFFERENTIAL_CASES.items():
        differential_case(name, c, differential, manifest)
    with open(f"{OUT}/manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
