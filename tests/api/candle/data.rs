//! `attn::candle::attention_with_data`: a document mask (i32 ids, no gradient) and
//! Forgetting-Transformer gates (f32, with a gradient) through candle's autograd, against the
//! f64 reference; data of the wrong type or name is an error.

use super::{tensor, values, var};
use attn::Variant;
use attn::candle::attention_with_data;
use attn::candle::core::{DType, Device, Tensor};
use attn::dsl::modifier::ParamValues;
use attn::dsl::reference::{self, Array, Inputs};

const SPEC: &str = "heads = 2, head_dim = 8, mask = causal, \
                    data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32), \
                    mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
                    score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]";

fn array(t: &Tensor) -> Array {
    Array::from_vec(t.dims(), values(t)).unwrap()
}

#[test]
fn documents_and_gates_train_through_candle_as_the_reference_computes_them() {
    let variant = Variant::parse(SPEC).unwrap();
    let (b, h, s, d) = (2, 2, 24, 8);
    let (q, k, v) = (
        var(&[b, h, s, d], 1),
        var(&[b, h, s, d], 2),
        var(&[b, h, s, d], 3),
    );
    let gate = var(&[b, h, s], 4);
    let ids: Vec<i64> = (0..b * s).map(|i| ((i % s) / 9 + i / s) as i64).collect();
    let doc = Tensor::from_vec(ids.clone(), (b, s), &Device::Cpu).unwrap();
    let (out, _) = attention_with_data(
        &variant,
        q.as_tensor(),
        k.as_tensor(),
        v.as_tensor(),
        &[],
        &[("doc", &doc), ("gate", gate.as_tensor())],
        0,
    )
    .unwrap();
    let dout = tensor(&[b, h, s, d], 5);
    let grads = (&out * &dout)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    let spec = variant.spec();
    let (qa, ka, va) = (
        array(q.as_tensor()),
        array(k.as_tensor()),
        array(v.as_tensor()),
    );
    let x = Inputs {
        q: &qa,
        k: &ka,
        v: &va,
        position_offset: 0,
    };
    let data = [
        ParamValues {
            name: "doc".into(),
            shape: vec![b, s],
            values: ids.iter().map(|x| *x as f64).collect(),
        },
        ParamValues {
            name: "gate".into(),
            shape: vec![b, h, s],
            values: values(gate.as_tensor()),
        },
    ];
    let want = reference::attention_learned(spec, &x, &data).unwrap();
    let back = reference::backward_learned(spec, &x, &array(&dout), &data).unwrap();
    let close = |what: &str, got: &Tensor, want: &[f64]| {
        let got = values(got);
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-5 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    };
    close("out", &out, want.out.data());
    close("dq", grads.get(&q).unwrap(), back.dq.data());
    close("dk", grads.get(&k).unwrap(), back.dk.data());
    close("dv", grads.get(&v).unwrap(), back.dv.data());
    assert_eq!(back.learned[0].name, "dgate");
    close("dgate", grads.get(&gate).unwrap(), &back.learned[0].values);

    // Ids as f32, an unknown name: errors naming them.
    let as_float = doc.to_dtype(DType::F32).unwrap();
    for (data, says) in [
        (
            vec![("doc", &as_float), ("gate", gate.as_tensor())],
            "data tensor `doc` is F32; the spec declares it i32",
        ),
        (
            vec![("doc", &doc), ("gates", gate.as_tensor())],
            "`gates` is not a data tensor of this spec",
        ),
    ] {
        let e = attention_with_data(
            &variant,
            q.as_tensor(),
            k.as_tensor(),
            v.as_tensor(),
            &[],
            &data,
            0,
        )
        .unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
    }
}

/// A packed window through a research model: the logits of its second document are those of
/// that document alone (RoPE sees only position differences, and the document mask hides the
/// first document), and with one document the window's logits are the plain forward's.
#[test]
fn a_packed_windows_documents_are_modelled_as_if_alone() {
    use attn::candle::CandleModel;
    use attn::candle::nn::{VarBuilder, VarMap};
    let config = attn::research::config_from_toml(
        "vocab = 50\nhidden = 32\nlayers = 2\n\
         attention = \"heads = 4, kv_heads = 2, head_dim = 8, mask = causal, position = rope\"",
    )
    .unwrap();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = CandleModel::new(&config, vb).unwrap();
    CandleModel::seed_weights(&varmap, 7).unwrap();
    let tokens: Vec<u32> = (0..20u32).map(|i| (i * 7 + 3) % 50).collect();
    let window = Tensor::from_vec(tokens.clone(), (1, 20), &Device::Cpu).unwrap();
    let docs: Vec<u32> = (0..20).map(|i| u32::from(i >= 8)).collect();
    let docs = Tensor::from_vec(docs, (1, 20), &Device::Cpu).unwrap();
    let packed = model.forward_documents(&window, &docs).unwrap();
    let second = Tensor::from_vec(tokens[8..].to_vec(), (1, 12), &Device::Cpu).unwrap();
    let alone = model.forward(&second).unwrap();
    let tail = packed.narrow(1, 8, 12).unwrap();
    super::assert_close("second document", &tail, &alone, 1e-4, 1e-4);
    let one = Tensor::zeros((1, 20), DType::U32, &Device::Cpu).unwrap();
    let plain = model.forward(&window).unwrap();
    super::assert_close(
        "one document",
        &model.forward_documents(&window, &one).unwrap(),
        &plain,
        1e-5,
        1e-5,
    );
    // Without the mask the second document's logits see the first: they differ.
    let unmasked = plain.narrow(1, 8, 12).unwrap();
    let differ = values(&unmasked)
        .iter()
        .zip(values(&alone))
        .any(|(a, b)| (a - b).abs() > 1e-3);
    assert!(differ);
}
