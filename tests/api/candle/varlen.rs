//! `attn::candle::attention_varlen`: a packed variable-length batch through candle's autograd,
//! against the runtime's own variable-length forward and backward (which the runtime's tests
//! check against the f64 reference), learned sinks included; bad offsets are errors.

use super::{tensor, values, var};
use attn::candle::attention_varlen;
use attn::candle::core::Tensor as CandleTensor;
use attn::runtime::varlen::{Varlen, VarlenSaved};
use attn::{Backend, CpuBackend, Learned, Tensor, Variant};

fn attn_tensor(t: &CandleTensor) -> Tensor {
    let v: Vec<f32> = values(t).iter().map(|&x| x as f32).collect();
    Tensor::from_f32(t.dims(), v).unwrap()
}

fn close(what: &str, got: &[f64], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        let w = f64::from(*w);
        assert!((g - w).abs() <= 1e-5 + 1e-4 * w.abs(), "{what}: {g} vs {w}");
    }
}

#[test]
fn a_packed_batch_trains_through_candle_as_the_runtime_computes_it() {
    let variant = Variant::parse(
        "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, position = rope, sinks = learned",
    )
    .unwrap();
    let (cu_q, cu_k) = ([0, 6, 6, 19], [0, 9, 9, 22]);
    let (q, k, v) = (
        var(&[19, 4, 16], 1),
        var(&[22, 2, 16], 2),
        var(&[22, 2, 16], 3),
    );
    let sinks = var(&[4], 4);
    let learned = [("sinks", sinks.as_tensor())];
    let (out, lse) = attention_varlen(
        &variant,
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        (&cu_q, &cu_k),
        &learned,
        2,
    )
    .unwrap();
    assert_eq!((out.dims(), lse.dims()), (&[19, 4, 16][..], &[19, 4][..]));
    let dout = tensor(&[19, 4, 16], 5);
    let grads = (&out * &dout)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    let (aq, ak, av, asinks) = (
        attn_tensor(q.as_tensor()),
        attn_tensor(k.as_tensor()),
        attn_tensor(v.as_tensor()),
        attn_tensor(sinks.as_tensor()),
    );
    let x = Varlen {
        q: &aq,
        k: &ak,
        v: &av,
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
    };
    let runtime_learned = [("sinks", &asinks)];
    let learned = Learned::new(&runtime_learned);
    let cpu = CpuBackend::new();
    let want = cpu.forward_varlen(&variant, x, 2, learned).unwrap();
    close("out", &values(&out), &want.out.to_f32_vec());
    close("lse", &values(&lse), &want.lse.to_f32_vec());
    let adout = attn_tensor(&dout);
    let saved = VarlenSaved {
        out: &want.out,
        lse: &want.lse,
        dout: &adout,
    };
    let g = cpu.backward_varlen(&variant, x, saved, 2, learned).unwrap();
    close("dq", &values(grads.get(&q).unwrap()), &g.dq.to_f32_vec());
    close("dk", &values(grads.get(&k).unwrap()), &g.dk.to_f32_vec());
    close("dv", &values(grads.get(&v).unwrap()), &g.dv.to_f32_vec());
    let (name, dsinks) = &g.learned[0];
    assert_eq!(name, "dsinks");
    close(
        "dsinks",
        &values(grads.get(&sinks).unwrap()),
        &dsinks.to_f32_vec(),
    );

    let bad = attention_varlen(
        &variant,
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        (&[0, 6, 18], &[0, 9, 22]),
        &[("sinks", sinks.as_tensor())],
        0,
    )
    .unwrap_err();
    assert!(
        bad.to_string().contains("cu_seqlens_q: ends at 18"),
        "{bad}"
    );
}

/// Data tensors in a packed batch through candle: document ids packed along k's rows, gates
/// `[heads, total_k]` whose gradient flows back through each sequence's slice, against the
/// runtime's variable-length calls (which the runtime's tests check per sequence against the
/// reference).
#[test]
fn a_packed_batchs_data_tensors_train_through_candle_as_the_runtime_computes_them() {
    use attn::candle::attention_varlen_with_data;
    use attn::candle::core::{Device, Tensor as C};
    use attn::runtime::learned::{Data, DataValues};
    let variant = Variant::parse(
        "heads = 2, head_dim = 8, mask = causal, \
         data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32), \
         mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
         score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]",
    )
    .unwrap();
    let (cu_q, cu_k) = ([0, 6, 6, 13], [0, 6, 6, 13]);
    let (q, k, v) = (
        var(&[13, 2, 8], 1),
        var(&[13, 2, 8], 2),
        var(&[13, 2, 8], 3),
    );
    let gate = var(&[2, 13], 4);
    let ids: Vec<i32> = (0..13).map(|j| i32::from(j % 6 >= 3)).collect();
    let doc = C::from_vec(ids.clone(), 13, &Device::Cpu).unwrap();
    let (out, _) = attention_varlen_with_data(
        &variant,
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        (&cu_q, &cu_k),
        &[],
        &[("doc", &doc), ("gate", gate.as_tensor())],
        0,
    )
    .unwrap();
    let dout = tensor(&[13, 2, 8], 5);
    let grads = (&out * &dout)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    let (aq, ak, av) = (
        attn_tensor(q.as_tensor()),
        attn_tensor(k.as_tensor()),
        attn_tensor(v.as_tensor()),
    );
    let gate_values: Vec<f32> = values(gate.as_tensor()).iter().map(|&x| x as f32).collect();
    let data = [
        (
            "doc",
            Data {
                shape: &[13],
                values: DataValues::I32(&ids),
            },
        ),
        (
            "gate",
            Data {
                shape: &[2, 13],
                values: DataValues::F32(&gate_values),
            },
        ),
    ];
    let x = Varlen {
        q: &aq,
        k: &ak,
        v: &av,
        cu_seqlens_q: &cu_q,
        cu_seqlens_k: &cu_k,
    };
    let tensors = Learned::none().with_data(&data);
    let cpu = CpuBackend::new();
    let want = cpu.forward_varlen(&variant, x, 0, tensors).unwrap();
    close("out", &values(&out), &want.out.to_f32_vec());
    let adout = attn_tensor(&dout);
    let saved = VarlenSaved {
        out: &want.out,
        lse: &want.lse,
        dout: &adout,
    };
    let g = cpu.backward_varlen(&variant, x, saved, 0, tensors).unwrap();
    close("dq", &values(grads.get(&q).unwrap()), &g.dq.to_f32_vec());
    let dgate = &g.learned.iter().find(|(n, _)| n == "dgate").unwrap().1;
    close(
        "dgate",
        &values(grads.get(&gate).unwrap()),
        &dgate.to_f32_vec(),
    );
}
