"""Context-parallel attention over torch.distributed (gloo, separate processes): each rank's
out and gradients equal the single call's rows, for Ulysses and the ring on 2 ranks (and the
ring on 3); the learnable tensors' shares sum to the single call's gradient; a peer that fails
is an error on the other rank within the group's timeout, not a hang."""

import datetime
import multiprocessing
import os
import pathlib
import traceback

import pytest
import torch

import attn
import attn.distributed
from conftest import assert_close

SPECS = [
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope",
    "heads = 4, head_dim = 16, mask = sliding_window(10), position = alibi, softcap = 5.0",
    "heads = 4, head_dim = 16, mask = causal, sinks = learned, params(slopes: [heads]), "
    "score_mod = |s, b, h, q, k| s - slopes[h] * ((q - k) as f32)",
    "heads = 4, head_dim = 16",
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, "
    "data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32), "
    "mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], "
    "score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]",
]
SEQ = 24


def whole(text):
    """The whole call's tensors (the same on every rank: a fixed seed)."""
    variant = attn.Variant(text)
    g = torch.Generator().manual_seed(7)
    b, h, kv, d = 2, variant.heads, variant.kv_heads, variant.head_dim
    q = torch.randn(b, h, SEQ, d, generator=g)
    k = torch.randn(b, kv, SEQ, d, generator=g)
    v = torch.randn(b, kv, SEQ, variant.v_head_dim, generator=g)
    w = torch.randn(b, h, SEQ, variant.v_head_dim, generator=g)
    params = {name: 0.1 * torch.randn(*shape, generator=g) for name, shape in variant.learnable}
    if variant.data:
        # Documents of 7 tokens (shifted by one in the second item) and gates.
        doc = torch.stack([torch.arange(SEQ) // 7, (torch.arange(SEQ) + 1) // 7]).int()
        params["doc"] = doc
        params["gate"] = 0.5 * torch.randn(b, h, SEQ, generator=g)
    return variant, q, k, v, w, params


def split(params):
    """Learnable tensors and data tensors, by name."""
    data = {n: t for n, t in params.items() if n in ("doc", "gate")}
    return {n: t for n, t in params.items() if n not in data}, data


def rank_main(rank, world, store, out_dir, scheme, fail):
    """One rank: its part of every spec's forward and backward, saved for the test."""
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=20),
        )
        if fail and rank == 1:
            raise SystemExit(3)
        results = []
        for text in SPECS:
            variant, q, k, v, w, params = whole(text)
            if scheme == "ulysses" and (variant.heads % world or variant.kv_heads % world):
                continue
            mine = attn.distributed.positions(variant, SEQ, scheme=scheme)
            part = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            mine_params = {
                n: t.clone().requires_grad_(t.dtype == torch.float32) for n, t in params.items()
            }
            learned, data = split(mine_params)
            out = attn.distributed.context_parallel_attention(
                *part, variant, scheme=scheme, params=learned, data=data, position_offset=5
            )
            (out * w[:, :, mine]).sum().backward()
            results.append({
                "text": text, "mine": mine, "out": out.detach(),
                "grads": [t.grad for t in part],
                "params": {n: t.grad for n, t in mine_params.items() if t.requires_grad},
            })
        torch.save(results, out_dir / f"{rank}.pt")
        torch.distributed.destroy_process_group()
    except BaseException as e:  # noqa: BLE001  (the test reads what happened)
        (out_dir / f"{rank}.err").write_text("".join(traceback.format_exception(e)))
        raise


def run_ranks(tmp_path, world, scheme, fail=False):
    context = multiprocessing.get_context("spawn")
    store = tmp_path / "store"
    processes = [
        context.Process(target=rank_main, args=(r, world, store, tmp_path, scheme, fail))
        for r in range(world)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode is not None, "a rank still runs after 120 s"
    return [p.exitcode for p in processes]


@pytest.mark.parametrize("scheme,world", [("ring", 2), ("ulysses", 2), ("ring", 3)])
def test_each_rank_gets_the_single_calls_rows_and_gradients(tmp_path, scheme, world):
    codes = run_ranks(tmp_path, world, scheme)
    errors = [(tmp_path / f"{r}.err") for r in range(world)]
    assert codes == [0] * world, [e.read_text() for e in errors if e.exists()]
    per_rank = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    checked = 0
    for i, text in enumerate(SPECS):
        found = [[x for x in results if x["text"] == text] for results in per_rank]
        if not found[0]:
            continue
        variant, q, k, v, w, params = whole(text)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        whole_params = {
            n: t.clone().requires_grad_(t.dtype == torch.float32) for n, t in params.items()
        }
        learned, data = split(whole_params)
        out = attn.attention(*inputs, variant, params=learned, data=data, position_offset=5)
        (out * w).sum().backward()
        for rank in range(world):
            got = found[rank][0]
            mine = got["mine"]
            assert_close(got["out"], out.detach()[:, :, mine], 1e-5, 1e-5, f"{text} out")
            for name, g, t in zip("qkv", got["grads"], inputs):
                assert_close(g, t.grad[:, :, mine], 1e-5, 1e-5, f"{text} d{name}")
        for name, t in ((n, t) for n, t in whole_params.items() if t.requires_grad):
            shares = sum(found[r][0]["params"][name] for r in range(world))
            assert_close(shares, t.grad, 1e-5, 1e-5, f"{text} d{name}")
        checked += 1
    assert checked >= 4


def test_a_rank_that_fails_is_an_error_on_the_others_not_a_hang(tmp_path):
    codes = run_ranks(tmp_path, 2, "ring", fail=True)
    assert codes[1] == 3
    assert codes[0] != 0
    error = (tmp_path / "0.err").read_text()
    # attn's error, naming the rank and the engine, with torch.distributed's reason.
    assert "AttnError: communication: rank 0: torch.distributed" in error, error


def test_bad_calls_are_refused_with_attns_message():
    with pytest.raises(attn.AttnError, match="torch.distributed initialized"):
        attn.distributed.context_parallel_attention(
            torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8),
            "heads = 2, head_dim = 8",
        )


def test_bad_calls_in_a_group_are_refused_and_one_rank_is_the_single_call(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        variant, q, k, v, _, _ = whole(SPECS[0])
        cp = attn.distributed.context_parallel_attention
        for call, message in [
            (lambda: cp(q, k, v, variant, scheme="zigzag"), "unknown context-parallel scheme"),
            (lambda: cp(q[:, :3], k, v, variant), "`q`"),
            (lambda: cp(q, k, v, variant, params={"nope": q}), "nope"),
            (lambda: cp(q, k, v, variant, position_offset=1.5), "position_offset"),
            (lambda: cp(q, "k", v, variant), "`k` is a str"),
            (lambda: cp(q.double(), k, v, variant), "float64"),
        ]:
            with pytest.raises(attn.AttnError, match=message):
                call()
        assert attn.distributed.positions(variant, SEQ).tolist() == list(range(SEQ))
        assert_close(cp(q, k, v, variant), attn.attention(q, k, v, variant), 1e-6, 1e-6, "one rank")
    finally:
        torch.distributed.destroy_process_group()
