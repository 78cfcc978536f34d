//! `#[attention(...)]` in a user's crate: two variants side by side, each with its spec.

use attn::{Attention, AttentionSpec, attention};

#[attention(heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = alibi)]
struct Gqa;

#[attention(
    heads = 16, head_dim = 128, mla(latent_rank = 512, rope_dim = 64),
    position = rope(scaling = yarn(factor = 40, original_max_position = 4096)),
    mask_mod = |b, h, q, k| (q / 64) == (k / 64)
)]
#[derive(Debug, Default)]
struct Latent {
    _label: &'static str,
}

/// Every kind of value a spec holds: floats that do not print short, every scaling's fields,
/// a score modifier with casts, a select and both int and float constants.
#[attention(
    heads = 6, kv_heads = 3, head_dim = 32, v_head_dim = 16, dtype = bf16,
    mask = sliding_window(100), softcap = 0.1, scale = 0.3,
    position = rope(base = 500000.3, dim = 16, layout = interleaved, scaling = llama3(factor = 8.0,
        low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position = 8192)),
    score_mod = |s, b, h, q, k| if (q - k) % 3 == 0 { s * (h as f32 + 0.1) } else { -s.abs() / (b as f32 + 1.5) },
    mask_mod = |b, h, q, k| !(k > q - 2 && h == 1)
)]
struct Everything;

#[attention(
    heads = 4, head_dim = 16, mla(latent_rank = 32, rope_dim = 8), mask = causal(top_left),
    position = rope(scaling = yarn(factor = 4.0, original_max_position = 2048, beta_fast = 16.0,
        beta_slow = 2.0, mscale = 0.707, mscale_all_dim = 1.0))
)]
struct YarnMla;

#[attention(heads = 2, head_dim = 8, position = rope(scaling = dynamic(factor = 2.0,
    original_max_position = 64)))]
struct DynamicNtk;

#[attention(heads = 2, head_dim = 8, position = rope(scaling = ntk(factor = 3.0)))]
struct StaticNtk;

#[attention(heads = 2, head_dim = 8, position = rope(scaling = linear(factor = 2.5)))]
struct Linear;

/// `let` bindings, unbraced and in a block.
#[attention(
    heads = 2, head_dim = 8, params(slope: [heads]),
    score_mod = |s, b, h, q, k| let d = (q - k).abs() as f32; s - slope[h] * d * d,
    mask_mod = |b, h, q, k| { let w = 4; q - k < w && k - q < w }
)]
struct Bindings;

#[attention(heads = 2, head_dim = 8, position = rope(scaling = longrope(short = [1.0, 1.5, 2.25,
    3.0], long = [1, 4, 16, 64.5], original_max_position = 4096, attention_factor = 1.19)))]
struct LongRope;

#[attention(heads = 2, head_dim = 8, position = xpos(scale_base = 256.0, gamma = 0.3))]
struct Xpos;

#[test]
fn the_macro_builds_the_spec_as_data_equal_to_its_text() {
    let specs = [
        (Everything::spec(), Everything::SPEC_TEXT),
        (YarnMla::spec(), YarnMla::SPEC_TEXT),
        (DynamicNtk::spec(), DynamicNtk::SPEC_TEXT),
        (StaticNtk::spec(), StaticNtk::SPEC_TEXT),
        (Linear::spec(), Linear::SPEC_TEXT),
        (Bindings::spec(), Bindings::SPEC_TEXT),
        (LongRope::spec(), LongRope::SPEC_TEXT),
        (Xpos::spec(), Xpos::SPEC_TEXT),
        (Gqa::spec(), Gqa::SPEC_TEXT),
        (Latent::spec(), Latent::SPEC_TEXT),
    ];
    for (data, text) in specs {
        let parsed: AttentionSpec = text.parse().unwrap();
        assert_eq!(*data, parsed, "{text}");
        assert_eq!(data.to_string(), text);
        data.validate().unwrap();
    }
    // Floats survive exactly, not as their printed digits.
    assert_eq!(Everything::spec().scale, Some(0.3));
    assert_eq!(Everything::spec().softcap, Some(0.1));
    let m = Everything::spec().score_mod.as_ref().unwrap();
    assert!((m.apply(2.0, 0, 2, 9, 3) - 4.2).abs() < 1e-12);
    assert_eq!(m.apply(2.0, 1, 0, 9, 4), -2.0 / 2.5);
    // The variant is made once and holds the spec's plans.
    assert!(std::sync::Arc::ptr_eq(
        Everything::variant(),
        Everything::variant()
    ));
    assert_eq!(Everything::variant().spec(), Everything::spec());
}

#[test]
fn each_struct_carries_its_own_validated_spec() {
    let gqa = Gqa::spec().clone();
    let expected: AttentionSpec =
        "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, position = alibi"
            .parse()
            .unwrap();
    assert_eq!(gqa, expected);
    assert_eq!(Gqa::SPEC_TEXT, expected.to_string());

    let latent = Latent::spec().clone();
    assert_eq!(latent.mla().unwrap().latent_rank, 512);
    assert_eq!(latent.rope().unwrap().dim, 64);
    assert!(latent.mask_mod.as_ref().unwrap().keeps(0, 0, 70, 64));
    assert!(!latent.mask_mod.as_ref().unwrap().keeps(0, 0, 70, 63));
    assert_ne!(gqa, latent);

    // The constants type code by the spec.
    assert_eq!(
        (Gqa::HEADS, Gqa::KV_HEADS, Gqa::HEAD_DIM, Gqa::V_HEAD_DIM),
        (8, 2, 64, 64)
    );
    assert_eq!(
        (Latent::HEADS, Latent::KV_HEADS, Latent::HEAD_DIM),
        (16, 1, 128)
    );
    assert_eq!(Latent::DTYPE, attn::DType::F32);
    let buffer = [0f32; Gqa::HEAD_DIM as usize];
    assert_eq!(buffer.len(), 64);
    // The spec is parsed once.
    assert!(std::ptr::eq(Gqa::spec(), Gqa::spec()));
    assert_eq!(Gqa::forward_plan().shape.group(), 4);
    assert_eq!(Latent::forward_plan().shape.qk_dim, 512 + 64);
    // Other attributes and fields are kept.
    assert_eq!(Latent::default()._label, "");
}

#[test]
fn the_typed_api_runs_on_the_cpu() {
    use attn::runtime::Tensor;
    let (b, s) = (1, 9);
    let values = |n: usize, k: usize| (0..n).map(|i| ((i * k) % 17) as f32 / 17.0 - 0.5).collect();
    let q = Tensor::from_f32(&[b, 8, s, 64], values(b * 8 * s * 64, 3)).unwrap();
    let k = Tensor::from_f32(&[b, 2, s, 64], values(b * 2 * s * 64, 5)).unwrap();
    let v = Tensor::from_f32(&[b, 2, s, 64], values(b * 2 * s * 64, 7)).unwrap();
    let out = Gqa::forward(&q, &k, &v).unwrap();
    assert_eq!(out.shape(), &[b, 8, s, 64]);
    let with_lse = Gqa::forward_with_lse(&q, &k, &v, 0).unwrap();
    assert_eq!(with_lse.out.to_f32_vec(), out.to_f32_vec());
    // Query 0 sees only key 0 (causal): its output is v[0] of its kv head.
    let o = out.to_f32_vec();
    let vv = v.to_f32_vec();
    for d in 0..64 {
        assert!((o[d] - vv[d]).abs() < 1e-6);
    }
    // A wrongly shaped input is an error, not a panic.
    assert!(Gqa::forward(&k, &k, &v).is_err());
    // On another backend: the GPU kernels, on the interpreter, agree with the CPU's.
    let gpu = Gqa::forward_on(&attn::runtime::gpu::sim::GpuSim::new(), &q, &k, &v, 0).unwrap();
    for (a, b) in gpu.out.to_f32_vec().iter().zip(&o) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

/// One sequence packed as a variable-length batch gives what the dense forward gives, row for
/// row, through the typed API; and its backward the dense backward's gradients.
#[test]
fn the_typed_api_takes_a_variable_length_batch() {
    use attn::CpuBackend;
    use attn::runtime::varlen::{Varlen, VarlenSaved};
    use attn::runtime::{HeadsBackward, Tensor};
    let s = 21;
    let dense =
        |h: usize, seed| attn::inputs::tensor(attn::DType::F32, &[1, h, s, 64], seed).unwrap();
    let (q, k, v, dout) = (dense(8, 1), dense(2, 2), dense(2, 3), dense(8, 4));
    // [1, H, S, D] as [S, H, D].
    let packed = |t: &Tensor| {
        let [_, h, s, d]: [usize; 4] = t.shape().try_into().unwrap();
        let x = t.to_f32_vec();
        let mut out = vec![0.0; x.len()];
        for (i, value) in x.into_iter().enumerate() {
            let (hi, si, di) = (i / (s * d), i / d % s, i % d);
            out[(si * h + hi) * d + di] = value;
        }
        Tensor::from_f32(&[s, h, d], out).unwrap()
    };
    let (pq, pk, pv, pdout) = (packed(&q), packed(&k), packed(&v), packed(&dout));
    let cu = [0, s as i32];
    let x = Varlen {
        q: &pq,
        k: &pk,
        v: &pv,
        cu_seqlens_q: &cu,
        cu_seqlens_k: &cu,
    };
    let cpu = CpuBackend::new();
    let got = Gqa::forward_varlen_on(&cpu, x, &[], 3).unwrap();
    let want = Gqa::forward_on(&cpu, &q, &k, &v, 3).unwrap();
    assert_eq!(got.out.to_f32_vec(), packed(&want.out).to_f32_vec());
    let saved = VarlenSaved {
        out: &got.out,
        lse: &got.lse,
        dout: &pdout,
    };
    let g = Gqa::backward_varlen_on(&cpu, x, saved, &[], 3).unwrap();
    let dense_x = HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &want.out,
        lse: &want.lse,
        dout: &dout,
        position_offset: 3,
    };
    let w = Gqa::backward_on(&cpu, &dense_x).unwrap();
    assert_eq!(g.dq.to_f32_vec(), packed(&w.dq).to_f32_vec());
    assert_eq!(g.dv.to_f32_vec(), packed(&w.dv).to_f32_vec());
}

#[test]
fn the_typed_api_decodes_against_a_paged_cache() {
    use attn::runtime::Tensor;
    let s = 9;
    let values = |n: usize, k: usize| (0..n).map(|i| ((i * k) % 17) as f32 / 17.0 - 0.5).collect();
    let q = Tensor::from_f32(&[1, 8, s, 64], values(8 * s * 64, 3)).unwrap();
    let kv = |k| Tensor::from_f32(&[1, 2, s, 64], values(2 * s * 64, k)).unwrap();
    let (k, v) = (kv(5), kv(7));
    let prefill = Gqa::forward(&q, &k, &v).unwrap().to_f32_vec();
    // The cache takes [kv_heads, tokens, dim]; decode the last query against all nine keys.
    let mut cache = Gqa::paged_cache(4, 3).unwrap();
    let seq = cache.add_sequence();
    let drop_batch = |t: &Tensor| Tensor::from_f32(&[2, s, 64], t.to_f32_vec()).unwrap();
    cache.append(seq, &drop_batch(&k), &drop_batch(&v)).unwrap();
    let last: Vec<f32> = (0..8)
        .flat_map(|h| q.to_f32_vec()[(h * s + s - 1) * 64..(h * s + s) * 64].to_vec())
        .collect();
    let q_last = Tensor::from_f32(&[1, 8, 1, 64], last).unwrap();
    let step = Gqa::decode(&q_last, &cache, &[seq])
        .unwrap()
        .out
        .to_f32_vec();
    for h in 0..8 {
        for d in 0..64 {
            let want = prefill[(h * s + s - 1) * 64 + d];
            assert!((step[h * 64 + d] - want).abs() < 1e-5, "head {h} dim {d}");
        }
    }
    assert_eq!(
        Gqa::decode_plan().kind,
        attn::codegen::plan::PlanKind::Decode
    );
}

#[test]
fn the_typed_api_gives_gradients_equal_to_the_reference() {
    use attn::dsl::reference::{Array, Inputs, backward};
    use attn::runtime::Tensor;
    let s = 11;
    let values = |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * k) % 17) as f32 / 17.0 - 0.5).collect()
    };
    let shapes = [[1, 8, s, 64], [1, 2, s, 64], [1, 2, s, 64], [1, 8, s, 64]];
    let data: Vec<Vec<f32>> = shapes
        .iter()
        .zip([3, 5, 7, 11])
        .map(|(shape, k)| values(shape.iter().product(), k))
        .collect();
    let t: Vec<Tensor> = shapes
        .iter()
        .zip(&data)
        .map(|(shape, d)| Tensor::from_f32(shape, d.clone()).unwrap())
        .collect();
    let a: Vec<Array> = shapes
        .iter()
        .zip(&data)
        .map(|(shape, d)| {
            Array::from_vec(shape, d.iter().map(|x| f64::from(*x)).collect()).unwrap()
        })
        .collect();
    let saved = Gqa::forward_with_lse(&t[0], &t[1], &t[2], 0).unwrap();
    let got = Gqa::backward(&t[0], &t[1], &t[2], &saved.out, &saved.lse, &t[3]).unwrap();
    let inputs = Inputs {
        q: &a[0],
        k: &a[1],
        v: &a[2],
        position_offset: 0,
    };
    let want = backward(Gqa::spec(), &inputs, &a[3]).unwrap();
    for (g, w) in [
        (&got.dq, &want.dq),
        (&got.dk, &want.dk),
        (&got.dv, &want.dv),
    ] {
        assert_eq!(g.shape(), w.shape());
        for (x, y) in g.to_f32_vec().iter().zip(w.data()) {
            assert!(
                (f64::from(*x) - y).abs() <= 2e-5 + 2e-4 * y.abs(),
                "{x} vs {y}"
            );
        }
    }
    // MLA variants refuse, by name.
    let err = Latent::backward(&t[0], &t[1], &t[2], &saved.out, &saved.lse, &t[3]).unwrap_err();
    assert!(err.to_string().contains("MLA"), "{err}");
}

/// Learnable tensors: a relative-position table read with a clamp, and sinks.
#[attention(
    heads = 2, head_dim = 16, mask = causal, sinks = learned, params(rel: [heads, 8]),
    score_mod = |s, b, h, q, k| s + rel[h, max(min(q - k, 7), 0)]
)]
struct Learned;

#[test]
fn the_typed_api_names_and_shapes_the_learnable_tensors() {
    use attn::dsl::modifier::ParamValues;
    use attn::dsl::reference::{Array, Inputs, attention_learned};
    use attn::runtime::Tensor;
    assert_eq!(
        Learned::LEARNED,
        &[("rel", &[2usize, 8][..]), ("sinks", &[2][..])]
    );
    assert!(Gqa::LEARNED.is_empty());
    let parsed: AttentionSpec = Learned::SPEC_TEXT.parse().unwrap();
    assert_eq!(*Learned::spec(), parsed);

    let (s, values) = (9, |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * k) % 13) as f32 / 13.0 - 0.5).collect()
    });
    let shapes = [[1, 2, s, 16]; 3];
    let data: Vec<Vec<f32>> = (0..3).map(|i| values(2 * s * 16, 3 + 2 * i)).collect();
    let t: Vec<Tensor> = data
        .iter()
        .map(|d| Tensor::from_f32(&shapes[0], d.clone()).unwrap())
        .collect();
    let rel = Tensor::from_f32(&[2, 8], values(16, 5)).unwrap();
    let sinks = Tensor::from_f32(&[2], vec![0.5, -1.0]).unwrap();
    let got = Learned::forward_learned(&t[0], &t[1], &t[2], &[("rel", &rel), ("sinks", &sinks)], 0)
        .unwrap();
    let arrays: Vec<Array> = data
        .iter()
        .map(|d| Array::from_vec(&shapes[0], d.iter().map(|x| f64::from(*x)).collect()).unwrap())
        .collect();
    let learned = [
        ParamValues {
            name: "rel".into(),
            shape: vec![2, 8],
            values: rel.to_f32_vec().iter().map(|x| f64::from(*x)).collect(),
        },
        ParamValues {
            name: "sinks".into(),
            shape: vec![2],
            values: vec![0.5, -1.0],
        },
    ];
    let inputs = Inputs {
        q: &arrays[0],
        k: &arrays[1],
        v: &arrays[2],
        position_offset: 0,
    };
    let want = attention_learned(Learned::spec(), &inputs, &learned).unwrap();
    for (x, y) in got.out.to_f32_vec().iter().zip(want.out.data()) {
        assert!(
            (f64::from(*x) - y).abs() <= 2e-5 + 2e-4 * y.abs(),
            "{x} vs {y}"
        );
    }
    // Without them, the call names what is missing.
    let err = Learned::forward(&t[0], &t[1], &t[2]).unwrap_err();
    assert!(err.to_string().contains("`rel`"), "{err}");
}

/// Data tensors on a declared type: document ids and gates by name, the forward and backward
/// against the reference, the gates' gradient among the learned ones.
#[attention(
    heads = 2, head_dim = 8, mask = causal,
    data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32),
    mask_mod = |b, h, q, k| doc[b, q] == doc[b, k],
    score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]
)]
struct Packed;

#[test]
fn the_typed_api_takes_data_tensors() {
    use attn::dsl::modifier::ParamValues;
    use attn::dsl::reference::{self, Array, Inputs};
    use attn::runtime::learned::{Data, DataValues};
    use attn::runtime::{HeadsBackward, Learned as Tensors, Tensor};
    // The macro's spec is the text's.
    let text = Packed::spec().to_string();
    assert_eq!(
        text.parse::<AttentionSpec>().unwrap(),
        *Packed::spec(),
        "{text}"
    );
    let (b, h, s, d) = (1, 2, 14, 8);
    let values = |n: usize, k: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * k) % 13) as f32 / 13.0 - 0.5).collect()
    };
    let inputs: Vec<Vec<f32>> = [3, 5, 7, 11].map(|k| values(b * h * s * d, k)).into();
    let t: Vec<Tensor> = inputs
        .iter()
        .map(|v| Tensor::from_f32(&[b, h, s, d], v.clone()).unwrap())
        .collect();
    let ids: Vec<i32> = (0..s as i32).map(|j| j / 5).collect();
    let gate = values(b * h * s, 2);
    let data = [
        (
            "doc",
            Data {
                shape: &[b, s],
                values: DataValues::I32(&ids),
            },
        ),
        (
            "gate",
            Data {
                shape: &[b, h, s],
                values: DataValues::F32(&gate),
            },
        ),
    ];
    let cpu = attn::CpuBackend::new();
    let tensors = Tensors::none().with_data(&data);
    let saved = Packed::forward_with_data_on(&cpu, &t[0], &t[1], &t[2], tensors, 0).unwrap();
    let x = HeadsBackward {
        q: &t[0],
        k: &t[1],
        v: &t[2],
        out: &saved.out,
        lse: &saved.lse,
        dout: &t[3],
        position_offset: 0,
    };
    let got = Packed::backward_with_data_on(&cpu, &x, tensors).unwrap();
    let a: Vec<Array> = inputs
        .iter()
        .map(|v| Array::from_vec(&[b, h, s, d], v.iter().map(|x| f64::from(*x)).collect()).unwrap())
        .collect();
    let refs = [
        ParamValues {
            name: "doc".into(),
            shape: vec![b, s],
            values: ids.iter().map(|x| f64::from(*x)).collect(),
        },
        ParamValues {
            name: "gate".into(),
            shape: vec![b, h, s],
            values: gate.iter().map(|x| f64::from(*x)).collect(),
        },
    ];
    let x = Inputs {
        q: &a[0],
        k: &a[1],
        v: &a[2],
        position_offset: 0,
    };
    let want = reference::backward_learned(Packed::spec(), &x, &a[3], &refs).unwrap();
    let close = |g: &[f32], w: &[f64]| {
        assert_eq!(g.len(), w.len());
        for (x, y) in g.iter().zip(w) {
            assert!(
                (f64::from(*x) - y).abs() <= 2e-5 * (1.0 + y.abs()),
                "{x} vs {y}"
            );
        }
    };
    close(&got.dq.to_f32_vec(), want.dq.data());
    close(&got.dk.to_f32_vec(), want.dk.data());
    close(&got.dv.to_f32_vec(), want.dv.data());
    assert_eq!(got.learned[0].0, "dgate");
    close(&got.learned[0].1.to_f32_vec(), &want.learned[0].values);
}
