"""Seeded hostile input on every argument of the Python API: each call returns tensors or raises
attn.AttnError, never another exception, a crash or a hang; the op works after each."""

import random

import pytest
import torch

import attn

BASE = "heads = 4, kv_heads = 2, head_dim = 8, mask = causal"
PIECES = [
    "heads = 4", "heads = 0", "heads = 3", "heads = 4294967296", "kv_heads = 2", "kv_heads = 0",
    "head_dim = 8", "head_dim = 0", "head_dim = 100000", "mask = causal", "mask = none",
    "mask = sliding_window(3)", "mask = sliding_window(0)", "position = rope", "position = alibi",
    "softcap = 5.0", "softcap = -1.0", "dtype = bf16", "dtype = f16", "sinks = learned",
    "params(bias: [heads])", "score_mod = |s, b, h, q, k| s + bias[h]",
    "data(doc: [batch, seq] i32)", "mask_mod = |b, h, q, k| doc[b, q] == doc[b, k]",
    "score_mod = |s, b, h, q, k| s / 0.0", "mla(latent_rank = 8, rope_dim = 4)",
    "((((((((", "|", "= =", "heads", "\\u0000", "é",
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.bool, torch.uint8]


def random_spec(rng):
    if rng.random() < 0.6:
        return BASE
    items = rng.sample(PIECES, rng.randint(0, 6))
    text = ", ".join(items)
    if rng.random() < 0.2 and text:
        at = rng.randrange(len(text))
        text = text[:at] + rng.choice(",=|()[]0 x") + text[at + 1:]
    return text


def random_tensor(rng):
    roll = rng.random()
    if roll < 0.05:
        return rng.choice([None, 3, "q", [1.0], object()])
    if roll < 0.5:  # near the right shape
        shape = [rng.choice([1, 2]), rng.choice([2, 4]), rng.choice([0, 1, 5, 9]), rng.choice([8, 8, 7])]
    else:
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 5))]
    dtype = rng.choice(DTYPES[:3] * 3 + DTYPES)
    t = (torch.randn(shape) * rng.choice([1.0, 1e30, float("nan")])).to(dtype)
    if t.dim() >= 2 and rng.random() < 0.3:
        t = t.transpose(0, -1)
    if t.dim() >= 1 and t.shape[0] == 1 and rng.random() < 0.2:
        t = t.expand(rng.choice([3, 1 << 20, 1 << 40]), *t.shape[1:])
    return t


def random_named(rng, names):
    if rng.random() < 0.5:
        return None
    return {rng.choice(names): random_tensor(rng) for _ in range(rng.randint(0, 3))}


def random_inputs(rng):
    """q, k and v: fitting BASE, with at most one of them hostile, or all three random."""
    if rng.random() < 0.3:
        return [random_tensor(rng) for _ in range(3)]
    batch, s = rng.choice([1, 2]), rng.choice([0, 1, 5, 9])
    xs = [torch.randn(batch, h, s, 8) * rng.choice([1.0, 1e30]) for h in (4, 2, 2)]
    if rng.random() < 0.7:
        xs[rng.randrange(3)] = random_tensor(rng)
    return xs


def hostile_call(rng):
    """A call of BASE on fitting inputs with one argument (or, one time in five, every
    argument) made hostile."""
    every = rng.random() < 0.2
    aspect = rng.choice(["spec", "tensors", "params", "data", "offset", "cu", "none"])
    hostile = lambda name: every or aspect == name  # noqa: E731
    batch, s = rng.choice([1, 2]), rng.choice([0, 1, 5, 9])
    q, k, v = (torch.randn(batch, h, s, 8) for h in (4, 2, 2))
    if hostile("tensors"):
        q, k, v = random_inputs(rng)
    kwargs = dict(return_lse=rng.random() < 0.5)
    if hostile("offset"):
        kwargs["position_offset"] = rng.choice([3, -5, 2**40, 2**63 - 1, -(2**63), 2**70, 1.5])
    if hostile("params"):
        kwargs["params"] = random_named(rng, ["bias", "sinks", "other", "0"])
    if hostile("data"):
        kwargs["data"] = random_named(rng, ["doc", "gate", "x"])
    if hostile("cu"):
        offsets = torch.tensor(sorted(rng.sample(range(-2, 12), rng.randint(0, 4))), dtype=torch.int32)
        kwargs["cu_seqlens_q"] = offsets
        kwargs["cu_seqlens_k"] = random_tensor(rng) if rng.random() < 0.3 else offsets
    return (random_spec(rng) if hostile("spec") else BASE), (q, k, v), kwargs


@pytest.mark.parametrize("seed", range(8))
def test_hostile_calls_return_or_raise_attn_error(seed):
    rng = random.Random(seed)
    ok = refused = 0
    for _ in range(60):
        spec, (q, k, v), kwargs = hostile_call(rng)
        for t in (q, k, v):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and rng.random() < 0.5:
                t.requires_grad_(True)
        try:
            result = attn.attention(q, k, v, spec, **kwargs)
        except attn.AttnError:
            refused += 1
            continue
        ok += 1
        out = result[0] if isinstance(result, tuple) else result
        assert isinstance(out, torch.Tensor)
        if out.requires_grad:
            try:
                out.float().sum().backward()
            except attn.AttnError:
                pass
    # The op still answers right after the hostile calls.
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    assert torch.isfinite(attn.attention(q, k, k, BASE)).all()
    assert refused > 0 and ok > 0, (ok, refused)


@pytest.mark.parametrize("seed", range(4))
def test_hostile_backward_calls_raise_attn_error(seed):
    rng = random.Random(100 + seed)
    for _ in range(30):
        q = torch.randn(1, 4, 6, 8, requires_grad=True)
        k = torch.randn(1, 2, 6, 8, requires_grad=True)
        out = attn.attention(q, k, k, BASE)
        dout = random_tensor(rng)
        if not isinstance(dout, torch.Tensor):
            continue  # torch's backward() refuses it before autograd runs
        try:
            out.backward(dout)
        except attn.AttnError:
            pass
        except RuntimeError as e:
            # torch checks a gradient's shape and dtype against the output before any op runs.
            assert "shape" in str(e) or "dtype" in str(e) or "grad" in str(e), str(e)
