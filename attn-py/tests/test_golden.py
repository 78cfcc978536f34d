"""The op against PyTorch float64: the golden gradient cases (tests/fixtures/gradients, made by
PyTorch's autograd in float64 outside the project) and the float64 reference of reference.py
for what those cases do not hold (RoPE scalings, data tensors, variable-length batches)."""

import json

import pytest
import torch
from safetensors.torch import load_file

import attn
import reference
from conftest import FIXTURES, assert_close

GRADIENTS = FIXTURES / "gradients"
CASES = json.loads((GRADIENTS / "manifest.json").read_text())["cases"]
PER_HEAD = sorted(
    name for name, case in CASES.items()
    if "mla(" not in case["spec"] and "differential" not in case["spec"]
)
MLA = sorted(name for name, case in CASES.items() if "mla(" in case["spec"])
DIFFERENTIAL = sorted(name for name, case in CASES.items() if "differential" in case["spec"])
MLA_INPUTS = ("q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b")


def tolerance(case, name):
    """(atol, rtol) for tensor `name` of a case: tight for f32, and for f16/bf16 within a few
    times what PyTorch's own low-precision kernels miss by."""
    if case["dtype"] == "f32":
        return 2e-4, 1e-3
    lowp = case.get("torch_lowp_grad_max_abs_err", {})
    return max(0.03, 3 * lowp.get(name, 0.0)), 0.03


@pytest.mark.parametrize("name", PER_HEAD)
def test_golden_gradient_case(name):
    case = CASES[name]
    t = load_file(str(GRADIENTS / case["file"]))
    variant = attn.Variant(case["spec"])
    learned = {n: t[n] for n, _ in variant.learnable}
    for x in learned.values():
        x.requires_grad_(True)
    q, k, v = (t[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    out, lse = attn.attention(
        q, k, v, variant, position_offset=case["position_offset"], params=learned or None,
        return_lse=True,
    )
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    atol, rtol = tolerance(case, "out")
    assert_close(out, t["out"], atol, rtol, f"{name} out")
    assert_close(lse, t["lse"], atol, rtol, f"{name} lse")
    out.backward(t["dout"])
    for n, x in [("q", q), ("k", k), ("v", v)] + list(learned.items()):
        atol, rtol = tolerance(case, "d" + n)
        assert_close(x.grad, t["d" + n], atol, rtol, f"{name} d{n}")


@pytest.mark.parametrize("name", DIFFERENTIAL)
def test_golden_differential_case(name):
    # PyTorch's autograd in float64 on the paper's formulation: the output, the components' lse
    # and every gradient, lambda's vectors' included.
    case = CASES[name]
    t = load_file(str(GRADIENTS / case["file"]))
    q, k, v = (t[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    vectors = [t[n].clone().requires_grad_(True) for n in attn._differential.LAMBDA_NAMES]
    out, lse = attn.differential_attention(
        q, k, v, case["spec"], *vectors, position_offset=case["position_offset"],
        return_lse=True,
    )
    assert out.dtype == q.dtype and out.shape == t["out"].shape
    atol, rtol = tolerance(case, "out")
    assert_close(out, t["out"], atol, rtol, f"{name} out")
    assert_close(lse, t["lse"], atol, rtol, f"{name} lse")
    out.backward(t["dout"])
    named = [("q", q), ("k", k), ("v", v)] + list(zip(attn._differential.LAMBDA_NAMES, vectors))
    for n, x in named:
        atol, rtol = tolerance(case, "d" + n)
        # lambda's gradients sum over every output element: a looser bound in 16 bits.
        scale = 4 if n.startswith("lambda") and case["dtype"] != "f32" else 1
        assert_close(x.grad, t["d" + n], atol * scale, rtol * scale, f"{name} d{n}")


def test_differential_heads_refuse_what_does_not_pair():
    spec = "heads = 4, head_dim = 16, mask = causal, differential = lambda"
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16)
    vectors = [torch.zeros(16)] * 4
    with pytest.raises(attn.AttnError, match="one value head per pair"):
        attn.differential_attention(q, k, torch.randn(1, 4, 8, 16), spec, *vectors)
    with pytest.raises(attn.AttnError, match=r"lambda_k2.*\[head_dim\]"):
        attn.differential_attention(q, k, torch.randn(1, 2, 8, 16), spec, *vectors[:3],
                                    torch.zeros(15))
    with pytest.raises(attn.AttnError, match="no differential heads"):
        attn.differential_attention(q, k, torch.randn(1, 2, 8, 16), "heads = 4, head_dim = 16",
                                    *vectors)
    # attn.Variant plans one attention per head: it refuses the spec, naming the way that runs it.
    with pytest.raises(attn.AttnError, match="differential heads combine two attentions"):
        attn.Variant(spec)


@pytest.mark.parametrize("name", MLA)
def test_golden_mla_gradient_case(name):
    case = CASES[name]
    t = load_file(str(GRADIENTS / case["file"]))
    xs = [t[n].clone().requires_grad_(True) for n in MLA_INPUTS]
    out, lse = attn.attention_mla(
        *xs, case["spec"], position_offset=case["position_offset"], return_lse=True
    )
    atol, rtol = tolerance(case, "out")
    assert_close(out, t["out"], atol, rtol, f"{name} out")
    assert_close(lse, t["lse"], atol, rtol, f"{name} lse")
    out.backward(t["dout"])
    for n, x in zip(MLA_INPUTS, xs):
        # w_kv_b's gradient sums over every row and head: a looser bound in 16 bits.
        atol, rtol = tolerance(case, "d" + n)
        scale = 4 if n == "w_kv_b" and case["dtype"] != "f32" else 1
        assert_close(x.grad, t["d" + n], atol * scale, rtol * scale, f"{name} d{n}")


def check_against_reference(spec, shapes, ref_kwargs, *, position_offset=0, params=None,
                            data=None, atol=2e-5, rtol=1e-4):
    """Output and gradients (q, k, v and `params`/float data) of `spec` against
    reference.attention in float64 on the same f32 inputs."""
    q, k, v = (torch.randn(s) for s in shapes)
    dout = torch.randn(shapes[0][:-1] + (shapes[2][-1],))
    leaves = dict(params or {})
    leaves.update({n: x for n, x in (data or {}).items() if x.is_floating_point()})

    def run(fn):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        named = {n: x.clone().requires_grad_(True) for n, x in leaves.items()}
        out = fn(*xs, named)
        out.backward(dout.to(out.dtype))
        return out.detach(), [x.grad for x in xs], {n: x.grad for n, x in named.items()}

    def ours(q, k, v, named):
        p = {n: x for n, x in named.items() if n in (params or {})}
        d = {n: named.get(n, x) for n, x in (data or {}).items()}
        return attn.attention(q, k, v, spec, position_offset=position_offset,
                              params=p or None, data=d or None)

    def theirs(q, k, v, named):
        return reference.attention(q, k, v, position_offset=position_offset,
                                   **ref_kwargs(named))[0]

    got, want = run(ours), run(theirs)
    assert_close(got[0], want[0], atol, rtol, "out")
    for n, g, w in zip("qkv", got[1], want[1]):
        assert_close(g, w, atol, rtol, f"d{n}")
    for n in leaves:
        assert_close(got[2][n], want[2][n], atol * 10, rtol, f"d{n}")


@pytest.mark.parametrize(
    "scaling, spec_scaling",
    [
        (None, ""),
        ({"type": "linear", "factor": 4.0}, ", scaling = linear(factor = 4.0)"),
        ({"type": "ntk", "factor": 2.0}, ", scaling = ntk(factor = 2.0)"),
        (
            {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position": 64},
            ", scaling = llama3(factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, "
            "original_max_position = 64)",
        ),
        (
            {"type": "yarn", "factor": 4.0, "original_max_position": 64},
            ", scaling = yarn(factor = 4.0, original_max_position = 64)",
        ),
    ],
    ids=["plain", "linear", "ntk", "llama3", "yarn"],
)
def test_rope_scalings_with_gqa_and_an_offset(scaling, spec_scaling):
    spec = (f"heads = 4, kv_heads = 2, head_dim = 32, mask = causal, "
            f"position = rope(base = 10000.0{spec_scaling})")
    check_against_reference(
        spec, [(2, 4, 24, 32), (2, 2, 40, 32), (2, 2, 40, 32)],
        lambda _: dict(causal=True, rope_scaling={"scaling": scaling}),
        position_offset=100,
    )


def test_sliding_window_alibi_and_softcap():
    spec = ("heads = 4, head_dim = 16, mask = sliding_window(7), position = alibi, "
            "softcap = 5.0")
    check_against_reference(
        spec, [(1, 4, 33, 16)] * 3, lambda _: dict(causal=True, window=7, alibi=True, softcap=5.0)
    )


def test_a_custom_score_mod_and_mask_mod():
    spec = ("heads = 2, head_dim = 16, mask = causal, "
            "score_mod = |s, b, h, q, k| s - 0.1 * (q - k) as f32 * (h + 1) as f32, "
            "mask_mod = |b, h, q, k| (q - k) % 3 != 2")
    check_against_reference(
        spec, [(2, 2, 20, 16)] * 3,
        lambda _: dict(
            causal=True,
            score_mod=lambda s, b, h, q, k: s - 0.1 * (q - k).double() * (h + 1).double(),
            mask_mod=lambda b, h, q, k: (q - k) % 3 != 2,
        ),
    )


def test_learned_parameters_and_sinks():
    spec = ("heads = 4, kv_heads = 2, head_dim = 16, mask = causal, params(bias: [heads]), "
            "score_mod = |s, b, h, q, k| s + bias[h] * (k - q) as f32, sinks = learned")
    params = {"bias": torch.randn(4) * 0.1, "sinks": torch.randn(4)}
    check_against_reference(
        spec, [(1, 4, 30, 16), (1, 2, 30, 16), (1, 2, 30, 16)],
        lambda p: dict(
            causal=True,
            score_mod=lambda s, b, h, q, k: s + p["bias"].double()[h] * (k - q).double(),
            sinks=p["sinks"],
        ),
        params=params,
    )


def test_data_tensors_a_document_mask_and_gates_with_gradients():
    spec = ("heads = 2, head_dim = 16, mask = causal, "
            "data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32), "
            "mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], "
            "score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]")
    doc = torch.tensor([[0] * 7 + [1] * 11 + [2] * 6, [0] * 24])
    gate = torch.randn(2, 2, 24) * 0.5
    check_against_reference(
        spec, [(2, 2, 24, 16)] * 3,
        lambda d: dict(
            causal=True,
            mask_mod=lambda b, h, q, k: doc[b, q] == doc[b, k],
            score_mod=lambda s, b, h, q, k: s + d["gate"].double()[b, h, q] - d["gate"].double()[b, h, k],
        ),
        data={"doc": doc, "gate": gate},
    )


def test_a_variable_length_batch_matches_each_sequence_alone():
    spec = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal"
    lens_q, lens_k = [5, 17, 0, 9], [5, 20, 3, 9]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 16, requires_grad=True)
    out, lse = attn.attention(q, k, v, spec, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert out.shape == (sum(lens_q), 4, 16) and lse.shape == (sum(lens_q), 4)
    dout = torch.randn_like(out)
    out.backward(dout)
    for i in range(len(lens_q)):
        rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            continue
        xs = [t.detach()[r].transpose(0, 1)[None].double().requires_grad_(True)
              for t, r in ((q, rq), (k, rk), (v, rk))]
        want, want_lse = reference.attention(*xs, causal=True)
        assert_close(out[rq].transpose(0, 1)[None], want, 2e-5, 1e-4, f"out of sequence {i}")
        assert_close(lse[rq].transpose(0, 1)[None], want_lse, 2e-5, 1e-4, f"lse of sequence {i}")
        want.backward(dout[rq].transpose(0, 1)[None].double())
        for n, t, r, x in (("q", q, rq, xs[0]), ("k", k, rk, xs[1]), ("v", v, rk, xs[2])):
            assert_close(t.grad[r].transpose(0, 1)[None], x.grad, 2e-5, 1e-4, f"d{n} of sequence {i}")


def test_a_variable_length_batch_with_data_matches_each_sequence_alone():
    spec = ("heads = 2, head_dim = 16, mask = causal, data(doc: [seq] i32, gate: [heads, seq] f32), "
            "mask_mod = |b, h, q, k| doc[q] == doc[k], "
            "score_mod = |s, b, h, q, k| s + gate[h, k]")
    lens = [6, 11]
    cu = torch.tensor([0, 6, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, 2, 16) for _ in range(3))
    doc = torch.tensor([0, 0, 1, 1, 1, 1] + [0] * 4 + [1] * 7, dtype=torch.int32)
    gate = torch.randn(2, 17, requires_grad=True)
    out = attn.attention(q, k, v, spec, data={"doc": doc, "gate": gate},
                         cu_seqlens_q=cu, cu_seqlens_k=cu)
    out.square().sum().backward()
    for i, n in enumerate(lens):
        r = slice(int(cu[i]), int(cu[i + 1]))
        g = gate.detach()[:, r].clone().requires_grad_(True)
        want, _ = reference.attention(
            *(t[r].transpose(0, 1)[None] for t in (q, k, v)), causal=True,
            mask_mod=lambda b, h, qp, kp: doc[r][qp] == doc[r][kp],
            score_mod=lambda s, b, h, qp, kp: s + g.double()[h, kp],
        )
        assert_close(out[r].transpose(0, 1)[None], want, 2e-5, 1e-4, f"out of sequence {i}")
        want.square().sum().backward()
        assert_close(gate.grad[:, r], g.grad, 2e-4, 1e-3, f"dgate of sequence {i}")
