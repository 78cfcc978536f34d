"""The op as torch sees it: opcheck, torch.compile without a graph break, inputs read in place,
strided inputs, the module, and a training step against the same model on float64 SDPA."""

import re

import pytest
import torch
import torch.nn.functional as F

import attn
from conftest import assert_close

GQA = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope"
LEARNED = ("heads = 4, head_dim = 16, mask = causal, params(bias: [heads]), "
           "score_mod = |s, b, h, q, k| s + bias[h] * (k - q) as f32, sinks = learned")


def qkv(b=2, h=4, hkv=2, s=24, d=16, dtype=torch.float32, grad=True):
    return [torch.randn(b, n, s, d, dtype=dtype, requires_grad=grad) for n in (h, hkv, hkv)]


@pytest.mark.parametrize("with_learned", [False, True], ids=["plain", "learned"])
def test_opcheck(with_learned):
    q, k, v = qkv(hkv=4 if with_learned else 2)
    spec = attn.Variant(LEARNED if with_learned else GQA).text
    names, tensors = "", []
    if with_learned:
        names = "bias,sinks"
        tensors = [torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)]
    torch.library.opcheck(
        torch.ops.attn.attention.default, (q, k, v, spec, 3, names, tensors, None, None)
    )


def test_opcheck_of_a_variable_length_batch():
    q = torch.randn(12, 4, 16, requires_grad=True)
    k, v = (torch.randn(15, 2, 16, requires_grad=True) for _ in range(2))
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 15], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.attn.attention.default,
        (q, k, v, attn.Variant(GQA).text, 0, "", [], cu_q, cu_k),
    )


def test_opcheck_of_mla():
    spec = attn.Variant(
        "heads = 2, head_dim = 16, mask = causal, mla(latent_rank = 32, rope_dim = 8), "
        "position = rope"
    ).text
    shapes = [(1, 2, 9, 16), (1, 2, 9, 8), (1, 12, 32), (1, 12, 8), (2 * 32, 32)]
    xs = [torch.randn(s, requires_grad=True) for s in shapes]
    torch.library.opcheck(torch.ops.attn.attention_mla.default, (*xs, spec, 3))


class Block(torch.nn.Module):
    """Projections around attn's attention with learnable tensors."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(64, 3 * 64)
        self.attention = attn.nn.Attention(LEARNED)
        with torch.no_grad():
            self.attention.bias.uniform_(-0.1, 0.1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return self.attention(q, k, v).transpose(1, 2).reshape(b, s, 64)


def test_torch_compile_fullgraph_traces_through_the_op_and_its_backward():
    eager = Block()
    compiled_block = Block()
    compiled_block.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 20, 64)
    want, got = eager(x), compiled(x)
    assert_close(got, want, 1e-6, 1e-6, "compiled out")
    want.square().sum().backward()
    got.square().sum().backward()
    for (n, a), (_, b) in zip(eager.named_parameters(), compiled_block.named_parameters()):
        assert_close(b.grad, a.grad, 1e-5, 1e-5, f"compiled d{n}")


def test_torch_compile_with_inductor():
    block = Block()
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(1, 16, 64)
    assert_close(compiled(x), block(x), 1e-5, 1e-5, "inductor out")


def peak_growth(fn):
    """Bytes the process's peak resident memory grows by while `fn` runs (Linux)."""
    def status(field):
        text = open("/proc/self/status").read()
        return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the present resident size
    except OSError as e:
        pytest.skip(f"the peak resident size cannot be reset here: {e}")
    before = status("VmRSS")
    result = fn()
    return status("VmHWM") - before, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contiguous_inputs_are_read_in_place(dtype):
    spec = "heads = 8, head_dim = 128, mask = causal" + (
        ", dtype = bf16" if dtype == torch.bfloat16 else "")
    q = torch.randn(1, 8, 256, 128, dtype=dtype)
    k, v = (torch.randn(1, 8, 16384, 128, dtype=dtype) for _ in range(2))
    attn.attention(q, k, v, spec)  # kernels compiled, buffers pooled
    grown, out = peak_growth(lambda: attn.attention(q, k, v, spec))
    each = k.numel() * k.element_size()
    # A copy of k or v alone would add `each` (64 or 32 MiB); the output is 1 MiB or less.
    assert grown < each / 4, f"peak grew {grown / 2**20:.1f} MiB; k and v are {each / 2**20} MiB each"


def test_outputs_are_shared_with_torch_and_writable():
    q, k, v = qkv(grad=False)
    out = attn.attention(q, k, v, GQA)
    assert out.is_contiguous() and out.device.type == "cpu"
    out.add_(1.0)  # torch owns the memory the kernels wrote
    assert torch.isfinite(out).all()


def test_bshd_views_and_strided_inputs_give_the_contiguous_result():
    q, k, v = qkv(grad=False)
    want = attn.attention(q, k, v, GQA)
    # BSHD storage read through a transposed view, without a copy.
    bshd = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not bshd[0].is_contiguous()
    assert_close(attn.attention(*bshd, GQA), want, 0, 0, "BSHD views")
    # Every other element of a wider last axis, and a broadcast (stride 0) batch.
    wide = [torch.stack([t, t], -1).flatten(-2)[..., ::2] for t in (q, k, v)]
    assert_close(attn.attention(*wide, GQA), want, 0, 0, "strided rows")
    expanded = [t[:1].expand(3, -1, -1, -1) for t in (q, k, v)]
    got = attn.attention(*expanded, GQA)
    for b in range(3):
        assert_close(got[b], want[0], 0, 0, f"broadcast batch {b}")


def test_the_module_owns_zero_initialized_learnable_tensors():
    module = attn.nn.Attention(LEARNED)
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == {
        "bias": (4,), "sinks": (4,)}
    assert all((p == 0).all() for p in module.parameters())
    q, k, v = qkv(hkv=4)
    module(q, k, v).sum().backward()
    assert module.bias.grad is not None and module.sinks.grad.abs().sum() > 0


def test_sigmoid_attention_matches_the_papers_eager_form_with_gradients():
    """normalize = sigmoid against sigmoid(QK^T / sqrt(d) + b) V, masked, in float64 autograd."""
    q, k, v = qkv(hkv=4, s=37)
    dout = torch.randn(2, 4, 37, 16)
    spec = "heads = 4, head_dim = 16, mask = causal, normalize = sigmoid(bias = -ln(37))"
    out = attn.attention(q, k, v, spec)
    got = torch.autograd.grad(out, (q, k, v), dout)
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = x[0] @ x[1].transpose(-1, -2) / 4.0 - torch.log(torch.tensor(37.0, dtype=torch.float64))
    keep = torch.ones(37, 37, dtype=torch.bool).tril()
    want = torch.where(keep, torch.sigmoid(s), torch.zeros((), dtype=s.dtype)) @ x[2]
    want_grads = torch.autograd.grad(want, x, dout.double())
    assert_close(out, want, 2e-5, 2e-4, "out")
    for name, g, w in zip("qkv", got, want_grads):
        assert_close(g, w, 2e-5, 2e-4, f"d{name}")
    torch.library.opcheck(
        torch.ops.attn.attention.default, (q, k, v, attn.Variant(spec).text, 0, "", [], None, None)
    )


def test_stick_breaking_matches_the_papers_eager_form_with_gradients():
    """normalize = stick_breaking against log sigmoid(s) plus the reversed cumulative sum of
    log(1 - sigmoid(s)) over the nearer kept keys, in float64 autograd."""
    q, k, v = qkv(hkv=4, s=70)
    dout = torch.randn(2, 4, 70, 16)
    out = attn.attention(q, k, v, "heads = 4, head_dim = 16, mask = causal, normalize = stick_breaking")
    got = torch.autograd.grad(out, (q, k, v), dout)
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = x[0] @ x[1].transpose(-1, -2) / 4.0
    keep = torch.ones(70, 70, dtype=torch.bool).tril()
    zero = torch.zeros((), dtype=s.dtype)
    rest = torch.where(keep, torch.nn.functional.logsigmoid(-s), zero)
    nearer = torch.flip(torch.cumsum(torch.flip(rest, [-1]), -1), [-1]) - rest
    want = torch.where(keep, torch.exp(torch.nn.functional.logsigmoid(s) + nearer), zero) @ x[2]
    want_grads = torch.autograd.grad(want, x, dout.double())
    assert_close(out, want, 2e-5, 2e-4, "out")
    for name, g, w in zip("qkv", got, want_grads):
        assert_close(g, w, 5e-5, 5e-4, f"d{name}")


def test_xpos_matches_the_papers_decay_with_gradients():
    """position = xpos against interleaved RoPE whose pairs are scaled by zeta^(n / 512) (q) and
    zeta^(-m / 512) (k), zeta_i = (2i / d + 0.4) / 1.4, in float64 autograd."""
    q, k, v = qkv(hkv=4, s=40)
    dout = torch.randn(2, 4, 40, 16)
    out = attn.attention(q, k, v, "heads = 4, head_dim = 16, mask = causal, position = xpos(scale_base = 32.0)")
    got = torch.autograd.grad(out, (q, k, v), dout)
    x = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pos = torch.arange(40, dtype=torch.float64)
    zeta = (torch.arange(0, 16, 2, dtype=torch.float64) / 16 + 0.4) / 1.4
    angle = pos[:, None] * 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)

    def rotate(t, sign):
        scale = zeta[None, :] ** (sign * pos[:, None] / 32.0)
        cos, sin = torch.cos(angle) * scale, torch.sin(angle) * scale
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)

    s = rotate(x[0], 1.0) @ rotate(x[1], -1.0).transpose(-1, -2) / 4.0
    keep = torch.ones(40, 40, dtype=torch.bool).tril()
    want = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ x[2]
    want_grads = torch.autograd.grad(want, x, dout.double())
    assert_close(out, want, 2e-5, 2e-4, "out")
    for name, g, w in zip("qkv", got, want_grads):
        assert_close(g, w, 2e-5, 2e-4, f"d{name}")


def test_the_module_starts_its_tensors_where_the_spec_says():
    spec = ("heads = 4, head_dim = 16, mask = causal, params(slopes: [heads] = alibi, "
            "w: [heads, 64] = normal(0.5), c: [1] = 0.25), "
            "score_mod = |s, b, h, q, k| let d = (q - k) as f32; s * c[0] - slopes[h] * d + w[h, 0]")
    module = attn.nn.Attention(spec)
    assert module.slopes.tolist() == [0.25, 0.0625, 0.015625, 0.00390625]
    assert module.c.tolist() == [0.25]
    assert 0.3 < module.w.std().item() < 0.7
    assert "= normal(0.5)" in module.spec and "let d = " in module.spec
    # torch's generator picks the draw.
    torch.manual_seed(1)
    a = attn.nn.Attention(spec).w.detach().clone()
    torch.manual_seed(1)
    assert torch.equal(attn.nn.Attention(spec).w, a)
    assert not torch.equal(attn.nn.Attention(spec).w, a)
    # A spec with no random start leaves torch's generator where it was (a model built with
    # it draws its other weights as it would without attn).
    torch.manual_seed(3)
    want = torch.rand(2)
    torch.manual_seed(3)
    attn.nn.Attention(LEARNED)
    assert torch.equal(torch.rand(2), want)


class TinyGPT(torch.nn.Module):
    """Two pre-norm blocks whose attention is `attend(q, k, v)` (BHSD)."""

    def __init__(self, attend, vocab=50, dim=32, heads=4):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(
                norm1=torch.nn.LayerNorm(dim), qkv=torch.nn.Linear(dim, 3 * dim),
                proj=torch.nn.Linear(dim, dim), norm2=torch.nn.LayerNorm(dim),
                mlp=torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                        torch.nn.Linear(4 * dim, dim))))
            for _ in range(2))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, s, dim = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = self.attend(q, k, v).transpose(1, 2).reshape(b, s, dim)
            x = x + blk["proj"](a.to(x.dtype))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(x)


def test_a_training_step_equals_the_same_model_on_float64_sdpa():
    ours = TinyGPT(lambda q, k, v: attn.attention(q, k, v, "heads = 4, head_dim = 8, mask = causal"))
    ref = TinyGPT(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)).double()
    ref.load_state_dict({n: p.double() for n, p in ours.state_dict().items()})
    tokens = torch.randint(0, 50, (3, 17))
    steps = []
    for model in (ours, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        steps.append((loss.item(), {n: p.detach().double() for n, p in model.named_parameters()}))
    assert abs(steps[0][0] - steps[1][0]) < 1e-5
    for n, p in steps[0][1].items():
        assert_close(p, steps[1][1][n], 2e-5, 1e-4, f"{n} after the step")


def test_the_gil_is_released_while_the_kernels_run():
    import threading
    import time

    q = torch.randn(1, 8, 2048, 64)
    spec = "heads = 8, head_dim = 64"
    attn.attention(q, q, q, spec)  # compiled and warm
    ticks, done = [], threading.Event()

    def count():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.01)
    start = time.perf_counter()
    attn.attention(q, q, q, spec)
    end = time.perf_counter()
    done.set()
    counter.join()
    during = [t for t in ticks if start < t < end]
    # With the GIL held, the other thread could not run Python until the call returned.
    assert end - start > 0.01 and len(during) >= 3, (end - start, len(during))


def test_variants_and_modules_pickle_and_deepcopy():
    import copy
    import io
    import pickle

    module = attn.nn.Attention(LEARNED)
    with torch.no_grad():
        module.bias.fill_(0.25)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert clone.variant == module.variant and clone.spec == module.spec
        assert torch.equal(clone.bias, module.bias)
        q, k, v = qkv(hkv=4, grad=False)
        assert torch.equal(clone(q, k, v), module(q, k, v))
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.variant.text == module.variant.text


def test_calls_from_several_threads_agree_with_calls_from_one():
    from concurrent.futures import ThreadPoolExecutor

    inputs = [qkv(grad=False) for _ in range(6)]
    want = [attn.attention(*x, GQA) for x in inputs]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda x: attn.attention(*x, GQA), inputs))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
