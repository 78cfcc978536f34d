"""Bad input raises attn.AttnError with attn's message (never a crash of the interpreter), NaN
inputs give NaN rows as `attnc run` does, and the op keeps working after each."""

import pytest
import torch

import attn

SPEC = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal"


def good():
    return (torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))


def still_works():
    q, k, v = good()
    assert torch.isfinite(attn.attention(q, k, v, SPEC)).all()


def refused(call, *fragments):
    with pytest.raises(attn.AttnError) as e:
        call()
    text = str(e.value)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    still_works()
    return text


def test_a_bad_spec_is_refused_with_attnc_checks_message_and_caret():
    text = refused(lambda: attn.Variant("heads = 4, head_dim = 16, mask = causl"),
                   "invalid value for `mask`", "causl", "^^^^^", "spec rejected: 1 error")
    assert "--> 1:" in text
    refused(lambda: attn.attention(*good(), "heads = 0, head_dim = 16"), "spec rejected")
    refused(lambda: attn.Variant("x" * 100_000), "bytes")


@pytest.mark.parametrize(
    "case, fragments",
    [
        (lambda q, k, v: (q.double(), k, v), ["`q`", "torch.float64"]),
        (lambda q, k, v: (q.to(torch.int32), k, v), ["`q`", "torch.int32"]),
        (lambda q, k, v: (q, k.to("meta"), v), ["`k`", "meta", "`q`", "cpu"]),
        (lambda q, k, v: (q[0], k, v), ["`q`", "[4, 8, 16]", "expected [B, heads, Sq, head_dim]"]),
        (lambda q, k, v: (q[..., :8], k, v), ["`q`", "16"]),
        (lambda q, k, v: (q, k[:, :1], v), ["`k`"]),
        (lambda q, k, v: (q, k, v[:, :, :5]), ["`v`"]),
        (lambda q, k, v: (q.tolist(), k, v), ["`q` is a list, not a torch.Tensor"]),
        (lambda q, k, v: (q, None, v), ["`k` is a NoneType"]),
        (lambda q, k, v: (q.to_sparse(), k, v), ["`q`", "layout"]),
    ],
    ids=["f64", "int", "meta device", "rank", "head_dim", "kv heads", "seq of v", "list",
         "none", "sparse"],
)
def test_bad_tensors_are_refused_naming_the_tensor(case, fragments):
    q, k, v = case(*good())
    refused(lambda: attn.attention(q, k, v, SPEC), *fragments)


def test_learnable_and_data_tensors_are_checked_against_the_spec():
    spec = ("heads = 4, head_dim = 16, mask = causal, params(bias: [heads]), "
            "data(doc: [batch, seq] i32), mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], "
            "score_mod = |s, b, h, q, k| s + bias[h]")
    q = torch.randn(1, 4, 8, 16)
    doc = torch.zeros(1, 8, dtype=torch.int64)
    bias = torch.zeros(4)
    ok = attn.attention(q, q, q, spec, params={"bias": bias}, data={"doc": doc})
    assert torch.isfinite(ok).all()
    for params, data, fragments in [
        (None, {"doc": doc}, ["bias"]),
        ({"bias": torch.zeros(3)}, {"doc": doc}, ["bias", "3"]),
        ({"bias": bias.double()}, {"doc": doc}, ["bias", "float32"]),
        ({"bias": bias, "other": bias}, {"doc": doc}, ["other"]),
        ({"bias": bias}, None, ["doc"]),
        ({"bias": bias}, {"doc": doc[:, :5]}, ["doc"]),
        ({"bias": bias}, {"doc": doc.float()}, ["doc", "int32"]),
        ({"bias": bias}, {"doc": doc + 2**40}, ["doc", "outside int32"]),
        ({"bias": bias}, {"doc": doc, "extra": doc}, ["extra"]),
        ({"bias": bias}, [("doc", doc)], ["`data` is a list"]),
        ({"bias": bias}, {"doc": "ids"}, ["`doc` is a str"]),
    ]:
        refused(lambda: attn.attention(q, q, q, spec, params=params, data=data), *fragments)


def test_variable_length_offsets_are_checked():
    q = torch.randn(10, 4, 16)
    k = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for cu_q, cu_k, fragment in [
        (cu, None, "go together"),
        (torch.tensor([0, 4, 11], dtype=torch.int32), cu, "cu_seqlens_q"),
        (torch.tensor([0, 5, 4, 10], dtype=torch.int32), torch.tensor([0, 2, 4, 10], dtype=torch.int32), "cu_seqlens_q"),
    ]:
        refused(lambda: attn.attention(q, k, k, SPEC, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k), fragment)


def test_other_arguments_are_checked():
    q, k, v = good()
    refused(lambda: attn.attention(q, k, v, 42), "`variant` is a int")
    refused(lambda: attn.attention(q, k, v, SPEC, position_offset=1.5), "position_offset")
    refused(lambda: attn.flex_attention(q, k, v, SPEC), "enable_gqa=True")
    refused(lambda: attn.flex_attention(q, k, v, SPEC, enable_gqa=True, scale=0.5), "scale")
    mla = "heads = 4, head_dim = 16, mla(latent_rank = 32, rope_dim = 16), position = rope"
    refused(lambda: attn.attention(q, k, v, mla), "is MLA", "attn.attention_mla")
    refused(lambda: attn.attention_mla(q, q, k, k, v, SPEC), "is not MLA", "attn.attention")
    refused(lambda: attn.attention_mla(q, q, k, k, [], mla), "`w_kv_b` is a list")


def test_nan_inputs_give_nan_rows_and_leave_the_other_rows_alone():
    q, k, v = good()
    want = attn.attention(q, k, v, SPEC)
    q[0, 1, 3] = float("nan")
    got = attn.attention(q, k, v, SPEC)
    assert torch.isnan(got[0, 1, 3]).all()
    rest = torch.ones_like(got, dtype=torch.bool)
    rest[0, 1, 3] = False
    assert torch.equal(got[rest], want[rest])


def test_the_flex_attention_port_matches_the_op():
    q, k, v = good()
    out, lse = attn.flex_attention(q, k, v, SPEC, enable_gqa=True, scale=0.25, return_lse=True)
    want, want_lse = attn.attention(q, k, v, SPEC, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_the_variant_describes_its_spec():
    v = attn.Variant("heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = rope")
    assert repr(v).startswith('attn.Variant("heads = 8, kv_heads = 2, head_dim = 64')
    assert (v.heads, v.kv_heads, v.head_dim, v.v_head_dim, v.dtype) == (8, 2, 64, 64, "float32")
    assert v.kv_bytes_per_token == 2 * 2 * 64 * 4
    assert v.flops(1, 128)["dense"] == 2 * (64 + 64) * 8 * 128 * 128
    assert v.flops(1, 128)["with_skipping"] == 2 * (64 + 64) * 8 * (128 * 129 // 2)
    assert v == attn.Variant(v.text) and hash(v) == hash(attn.Variant(v.text))


def test_broadcast_views_too_large_for_memory_are_refused():
    # Views of a few bytes that describe terabytes (stride-0 axes): refused before allocating.
    q = torch.randn(1, 4, 1, 8).expand(1 << 20, 4, 1 << 16, 8)
    k = torch.randn(1, 2, 1, 8).expand(1 << 20, 2, 1 << 16, 8)
    refused(lambda: attn.attention(q, k, k, SPEC), "GiB of memory")
    lse = torch.zeros(1, 1, 1).expand(1 << 20, 4, 1 << 16)
    spec = attn.Variant(SPEC).text
    refused(
        lambda: torch.ops.attn.attention_backward(q, k, k, q, lse, q, spec, 0, "", [], None, None),
        "GiB of memory",
    )
