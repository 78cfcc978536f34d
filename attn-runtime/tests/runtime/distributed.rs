//! Context-parallel attention over the in-process engine: Ulysses and ring attention on 2 and
//! 4 ranks give, for each variant, the single call's out, lse and every gradient (learned
//! tensors' too); the collectives move what they should, and a rank that fails or sends a
//! wrong-sized buffer is an error on every rank, not a hang.

use crate::support::values;
use attn_runtime::cpu::CpuBackend;
use attn_runtime::distributed::threads::group_with_timeout;
use attn_runtime::distributed::{Communicator, ContextParallel, Scheme, run_ranks, run_ranks_with};
use attn_runtime::learned::{Data, DataValues};
use attn_runtime::{
    Backend, BackwardInputs, HeadGradients, HeadsBackward, Inputs, Learned, Output, RuntimeError,
    Tensor, Variant,
};
use std::time::{Duration, Instant};

/// The variants, each with the learnable tensors it takes.
const VARIANTS: &[&str] = &[
    "heads = 4, head_dim = 16, mask = causal",
    "heads = 4, kv_heads = 2, head_dim = 16, mask = causal",
    "heads = 4, head_dim = 16, mask = sliding_window(20)",
    "heads = 4, head_dim = 16, mask = causal, position = rope",
    "heads = 4, head_dim = 16, mask = causal, position = rope(scaling = yarn(factor = 4.0, \
     original_max_position = 32))",
    "heads = 4, head_dim = 16, mask = causal, position = alibi",
    "heads = 4, head_dim = 16, mask = causal, softcap = 5.0",
    "heads = 4, head_dim = 16, mask = causal, score_mod = |s, b, h, q, k| s - 0.05 * \
     ((q - k) as f32) + (h as f32) * 0.25",
    "heads = 4, head_dim = 16, mask = causal, sinks = learned",
    "heads = 4, head_dim = 16, mask = causal, params(slopes: [heads]), score_mod = \
     |s, b, h, q, k| s - slopes[h] * ((q - k) as f32)",
    "heads = 4, head_dim = 16",
    "heads = 4, head_dim = 16, v_head_dim = 8, mask_mod = |b, h, q, k| k <= q || k < 12",
    "heads = 4, head_dim = 16, mask = causal, dtype = bf16",
];

/// A whole call's tensors: q, k, v, dout, and the learnable tensors by name.
struct Whole {
    variant: std::sync::Arc<Variant>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    learned: Vec<(String, Tensor)>,
}

impl Whole {
    fn new(text: &str, batch: usize, seq: usize) -> Whole {
        let spec: attn_dsl::AttentionSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
        let variant = Variant::shared(&spec).unwrap();
        let (h, kv) = (spec.heads as usize, spec.kv_heads() as usize);
        let (d, dv) = (spec.head_dim as usize, spec.v_head_dim as usize);
        let tensor = |shape: &[usize], seed| {
            let n = shape.iter().product();
            Tensor::from_f32_as(spec.dtype, shape, values(n, seed)).unwrap()
        };
        let learned = spec
            .learnable_tensors()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let n = shape.iter().product();
                let v = values(n, 40 + i as u64).iter().map(|x| 0.1 * x).collect();
                (name, Tensor::from_f32(&shape, v).unwrap())
            })
            .collect();
        Whole {
            q: tensor(&[batch, h, seq, d], 1),
            k: tensor(&[batch, kv, seq, d], 2),
            v: tensor(&[batch, kv, seq, dv], 3),
            dout: Tensor::from_f32(&[batch, h, seq, dv], values(batch * h * seq * dv, 4)).unwrap(),
            variant,
            learned,
        }
    }

    fn named(&self) -> Vec<(&str, &Tensor)> {
        self.learned.iter().map(|(n, t)| (n.as_str(), t)).collect()
    }

    /// The single process's forward and backward.
    fn single(&self, p0: i64, data: &[(&str, Data)]) -> (Output, HeadGradients) {
        let cpu = CpuBackend::new();
        let named = self.named();
        let learned = Learned::new(&named).with_data(data);
        let inputs = Inputs::heads(&self.q, &self.k, &self.v);
        let out = cpu
            .forward_learned(&self.variant, inputs, p0, learned)
            .unwrap();
        let x = HeadsBackward {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            out: &out.out,
            lse: &out.lse,
            dout: &self.dout,
            position_offset: p0,
        };
        let g = cpu
            .backward_learned(&self.variant, &BackwardInputs::Heads(x), learned)
            .unwrap()
            .heads()
            .unwrap();
        (out, g)
    }

    /// Every rank's forward and backward, put back together: out, lse, dq, dk, dv, and each
    /// rank's learned gradients.
    fn parallel(
        &self,
        scheme: Scheme,
        ranks: usize,
        p0: i64,
        data: &[(&str, Data)],
    ) -> ([Tensor; 5], Vec<Vec<(String, Tensor)>>) {
        let cpu = CpuBackend::new();
        let seq = self.q.shape()[2];
        let results = run_ranks(ranks, |comm| -> Result<_, RuntimeError> {
            let cp = ContextParallel::new(comm, &cpu, scheme);
            let split = cp.split(&self.variant, seq)?;
            let r = comm.rank();
            let (q, k, v) = (
                split.take(&self.q, r)?,
                split.take(&self.k, r)?,
                split.take(&self.v, r)?,
            );
            let dout = split.take(&self.dout, r)?;
            let named = self.named();
            let learned = Learned::new(&named).with_data(data);
            let out = cp.forward(&self.variant, [&q, &k, &v], p0, learned)?;
            let x = HeadsBackward {
                q: &q,
                k: &k,
                v: &v,
                out: &out.out,
                lse: &out.lse,
                dout: &dout,
                position_offset: p0,
            };
            let g = cp.backward(&self.variant, &x, learned)?;
            Ok((split, out, g))
        });
        let results: Vec<_> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|e| panic!("{scheme:?} on {ranks} ranks: {e}")))
            .collect();
        let split = results[0].0;
        let put = |f: &dyn Fn(&(_, Output, HeadGradients)) -> Tensor| {
            let parts: Vec<Tensor> = results.iter().map(f).collect();
            split.put(&parts).unwrap()
        };
        let whole = [
            put(&|r| r.1.out.clone()),
            put(&|r| r.1.lse.clone()),
            put(&|r| r.2.dq.clone()),
            put(&|r| r.2.dk.clone()),
            put(&|r| r.2.dv.clone()),
        ];
        let learned = results.into_iter().map(|r| r.2.learned).collect();
        (whole, learned)
    }
}

/// Asserts `got` within `tol` of `want` relative to the larger of 1 and `want`'s largest
/// magnitude.
fn close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes");
    let (g, w) = (got.to_f32_vec(), want.to_f32_vec());
    let scale = w.iter().fold(1f32, |m, x| m.max(x.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let same = (a.is_nan() && b.is_nan()) || a == b;
        assert!(
            same || (a - b).abs() <= tol * scale,
            "{what}[{i}]: {a} against {b} (scale {scale})"
        );
    }
}

fn check(text: &str, scheme: Scheme, ranks: usize, p0: i64) {
    let whole = Whole::new(text, 2, 48);
    let (want, wg) = whole.single(p0, &[]);
    let ([out, lse, dq, dk, dv], learned) = whole.parallel(scheme, ranks, p0, &[]);
    let tol = if text.contains("bf16") { 2e-2 } else { 1e-5 };
    let at = format!("{text} ({scheme:?}, {ranks} ranks, offset {p0})");
    close(&format!("{at} out"), &out, &want.out, tol);
    close(&format!("{at} lse"), &lse, &want.lse, tol);
    close(&format!("{at} dq"), &dq, &wg.dq, tol);
    close(&format!("{at} dk"), &dk, &wg.dk, tol);
    close(&format!("{at} dv"), &dv, &wg.dv, tol);
    for rank in &learned {
        assert_eq!(rank.len(), wg.learned.len(), "{at}: learned gradients");
        for ((name, got), (want_name, want)) in rank.iter().zip(&wg.learned) {
            assert_eq!(name, want_name, "{at}");
            close(&format!("{at} {name}"), got, want, tol);
        }
    }
}

#[test]
fn ring_attention_equals_the_single_call_for_every_variant() {
    for text in VARIANTS {
        check(text, Scheme::Ring, 2, 0);
        check(text, Scheme::Ring, 4, 7);
    }
}

#[test]
fn ulysses_equals_the_single_call_for_every_variant() {
    for text in VARIANTS {
        check(text, Scheme::Ulysses, 2, 0);
        if !text.contains("kv_heads = 2") {
            check(text, Scheme::Ulysses, 4, 7);
        }
    }
    // Sigmoid attention splits over heads as it stands.
    check(SIGMOID, Scheme::Ulysses, 2, 0);
}

/// Sigmoid attention's parts add around the ring (zigzag and plain splits), learned
/// parameters included.
#[test]
fn ring_sigmoid_attention_equals_the_single_call() {
    check(SIGMOID, Scheme::Ring, 2, 0);
    check(SIGMOID, Scheme::Ring, 4, 7);
    let plain = "heads = 4, head_dim = 16, normalize = sigmoid, params(slopes: [heads]), \
                 score_mod = |s, b, h, q, k| s - slopes[h] * ((q - k) as f32).abs()";
    check(plain, Scheme::Ring, 3, 0);
}

const SIGMOID: &str = "heads = 4, head_dim = 16, mask = causal, normalize = sigmoid(bias = -2.0)";

/// A document mask and per-token gates (data tensors of the whole sequence, read at global
/// positions) under both schemes, the gates' gradient included.
#[test]
fn document_masks_and_gates_split_over_heads_and_around_the_ring() {
    let text = "heads = 4, kv_heads = 2, head_dim = 16, mask = causal, \
                data(doc: [batch, seq] i32, gate: [batch, heads, seq] f32), \
                mask_mod = |b, h, q, k| doc[b, q] == doc[b, k], \
                score_mod = |s, b, h, q, k| s + gate[b, h, q] - gate[b, h, k]";
    let whole = Whole::new(text, 2, 48);
    let doc: Vec<i32> = (0..96).map(|i| i % 48 / 13 + i / 48).collect();
    let gate: Vec<f32> = values(2 * 4 * 48, 11).iter().map(|x| 0.5 * x).collect();
    let data = [
        (
            "doc",
            Data {
                shape: &[2, 48],
                values: DataValues::I32(&doc),
            },
        ),
        (
            "gate",
            Data {
                shape: &[2, 4, 48],
                values: DataValues::F32(&gate),
            },
        ),
    ];
    let (want, wg) = whole.single(3, &data);
    for (scheme, ranks) in [(Scheme::Ulysses, 2), (Scheme::Ring, 2), (Scheme::Ring, 4)] {
        let ([out, lse, dq, dk, dv], learned) = whole.parallel(scheme, ranks, 3, &data);
        for (what, got, want) in [
            ("out", &out, &want.out),
            ("lse", &lse, &want.lse),
            ("dq", &dq, &wg.dq),
            ("dk", &dk, &wg.dk),
            ("dv", &dv, &wg.dv),
        ] {
            close(&format!("{scheme:?} on {ranks}: {what}"), got, want, 1e-5);
        }
        for rank in &learned {
            let (name, got) = &rank[0];
            assert_eq!(name, "dgate");
            close(
                &format!("{scheme:?} on {ranks}: dgate"),
                got,
                &wg.learned[0].1,
                1e-5,
            );
        }
    }
}

/// What a context-parallel call refuses, with the reason.
#[test]
fn specs_and_shapes_context_parallelism_cannot_split_are_refused() {
    let cpu = CpuBackend::new();
    let cases: &[(&str, Scheme, usize, &str)] = &[
        (
            "heads = 3, head_dim = 16",
            Scheme::Ulysses,
            2,
            "divisible by the ranks",
        ),
        (
            "heads = 4, kv_heads = 1, head_dim = 16",
            Scheme::Ulysses,
            2,
            "divisible",
        ),
        (
            "heads = 4, head_dim = 16, mask = causal",
            Scheme::Ring,
            7,
            "divisible by 14",
        ),
        (
            "heads = 2, head_dim = 16, mask = causal(top_left)",
            Scheme::Ring,
            2,
            "top-left",
        ),
        (
            "heads = 2, head_dim = 16, position = rope(scaling = dynamic(factor = 2.0, \
             original_max_position = 16))",
            Scheme::Ring,
            2,
            "dynamic NTK",
        ),
    ];
    for &(text, scheme, ranks, why) in cases {
        let whole = Whole::new(text, 1, 24);
        let local = 24 / ranks;
        let errors = run_ranks(ranks, |comm| {
            let cp = ContextParallel::new(comm, &cpu, scheme);
            let narrow = |t: &Tensor| {
                let mut shape = t.shape().to_vec();
                shape[2] = local;
                let n = shape.iter().product();
                Tensor::from_f32_as(t.dtype(), &shape, values(n, 9)).unwrap()
            };
            let (q, k, v) = (narrow(&whole.q), narrow(&whole.k), narrow(&whole.v));
            match cp.forward(&whole.variant, [&q, &k, &v], 0, Learned::none()) {
                Ok(_) => "accepted".to_string(),
                Err(e) => e.to_string(),
            }
        });
        for e in errors {
            assert!(e.contains(why), "{text} ({scheme:?}): {e}");
        }
    }
    // A rank's q of the wrong head count.
    let whole = Whole::new("heads = 4, head_dim = 16, mask = causal", 1, 16);
    let errors = run_ranks(2, |comm| {
        let cp = ContextParallel::new(comm, &cpu, Scheme::Ring);
        let q = Tensor::from_f32(&[1, 3, 8, 16], values(3 * 8 * 16, 1)).unwrap();
        let k = whole.k.clone();
        cp.forward(&whole.variant, [&q, &k, &k], 0, Learned::none())
            .unwrap_err()
            .to_string()
    });
    assert!(errors.iter().all(|e| e.contains("`q`")), "{errors:?}");
}

#[test]
fn the_collectives_move_what_they_should() {
    let got = run_ranks(3, |comm| {
        let r = comm.rank() as f32;
        let mut sum = vec![r, 10.0 * r];
        comm.all_reduce_sum(&mut sum).unwrap();
        let mut gathered = vec![0.0; 3];
        comm.all_gather(&[r], &mut gathered).unwrap();
        // Block j of rank r's buffer holds 10 r + j.
        let send: Vec<f32> = (0..6).map(|i| 10.0 * r + (i / 2) as f32).collect();
        let mut recv = vec![0.0; 6];
        comm.all_to_all(&send, &mut recv).unwrap();
        let mut ring = vec![0.0; 2];
        comm.send_recv(
            &[r, r],
            (comm.rank() + 1) % 3,
            &mut ring,
            (comm.rank() + 2) % 3,
        )
        .unwrap();
        comm.barrier().unwrap();
        (sum, gathered, recv, ring)
    });
    for (r, (sum, gathered, recv, ring)) in got.into_iter().enumerate() {
        assert_eq!(sum, vec![3.0, 30.0]);
        assert_eq!(gathered, vec![0.0, 1.0, 2.0]);
        let from = |i: usize| 10.0 * i as f32 + r as f32;
        assert_eq!(
            recv,
            vec![from(0), from(0), from(1), from(1), from(2), from(2)]
        );
        let prev = ((r + 2) % 3) as f32;
        assert_eq!(ring, vec![prev, prev]);
    }
}

/// A rank that sends a buffer of another size, one that returns early and one that stays
/// silent: every rank gets an error, within the group's timeout.
#[test]
fn a_failing_rank_is_an_error_on_every_rank_in_bounded_time() {
    let wrong = run_ranks(3, |comm| {
        let n = if comm.rank() == 1 { 5 } else { 4 };
        let mut sum = vec![1.0; n];
        comm.all_reduce_sum(&mut sum).map_err(|e| e.to_string())
    });
    for e in &wrong {
        let e = e.as_ref().unwrap_err();
        assert!(
            e.contains("values; this call expects") || e.contains("left the group"),
            "{e}"
        );
    }

    let left = run_ranks(3, |comm| {
        if comm.rank() == 2 {
            return Err("rank 2 stopped".to_string());
        }
        let mut sum = vec![1.0; 4];
        comm.all_reduce_sum(&mut sum).map_err(|e| e.to_string())
    });
    // Rank 0 sees rank 2 leave, or rank 1, which left on seeing rank 2 leave first.
    assert_eq!(left[2], Err("rank 2 stopped".to_string()));
    for e in &left[..2] {
        let e = e.as_ref().unwrap_err();
        assert!(e.contains("left the group"), "{e}");
    }

    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let silent = run_ranks_with(group_with_timeout(2, Duration::from_millis(300)), |comm| {
        if comm.rank() == 1 {
            // Alive but silent until rank 0 has given up.
            let _ = rx.lock().unwrap().recv_timeout(Duration::from_secs(5));
            return Ok(());
        }
        let mut sum = vec![1.0; 4];
        let result = comm.all_reduce_sum(&mut sum).map_err(|e| e.to_string());
        tx.send(()).unwrap();
        result
    });
    let e = silent[0].as_ref().unwrap_err();
    assert!(e.contains("no message from rank 1 within 0.3 s"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// Hostile context-parallel calls: random specs, schemes, rank counts, lengths (0 included),
/// offsets, and now and then a tensor of the wrong shape or dtype. Every rank answers (no
/// panic, no hang); when all succeed, the parts put together equal the single call.
#[test]
fn random_context_parallel_calls_answer_or_refuse_and_never_panic() {
    let mut rng = attn_runtime::inputs::XorShift::new(0xC0_7E47);
    let mut pick = |n: u64| (rng.next_u64() % n) as usize;
    let (mut answered, mut refused) = (0, 0);
    for case in 0..120 {
        let heads = 1 + pick(4);
        let kv = [1, heads][pick(2)];
        let mask = [
            "",
            ", mask = causal",
            ", mask = sliding_window(5)",
            ", mask = causal(top_left)",
        ][pick(4)];
        let position = ["", ", position = rope", ", position = alibi"][pick(3)];
        let dtype = ["", ", dtype = bf16"][pick(2)];
        let text = format!("heads = {heads}, kv_heads = {kv}, head_dim = 8{mask}{position}{dtype}");
        let spec: attn_dsl::AttentionSpec = text.parse().unwrap();
        let variant = Variant::shared(&spec).unwrap();
        let (ranks, local, batch) = (1 + pick(4), pick(7), 1 + pick(2));
        let scheme = [Scheme::Ring, Scheme::Ulysses][pick(2)];
        let p0 = pick(11) as i64 - 5;
        let spoil = pick(8);
        let cpu = CpuBackend::new();
        let seq = local * ranks;
        let whole = |heads: usize, seed| {
            let n = batch * heads * seq * 8;
            Tensor::from_f32_as(spec.dtype, &[batch, heads, seq, 8], values(n, seed)).unwrap()
        };
        let (q, k, v) = (whole(heads, 1), whole(kv, 2), whole(kv, 3));
        let dout = whole(heads, 4);
        let results = run_ranks(ranks, |comm| {
            let cp = ContextParallel::new(comm, &cpu, scheme);
            let split = cp.split(&variant, seq)?;
            let r = comm.rank();
            let (mut ql, kl, vl) = (split.take(&q, r)?, split.take(&k, r)?, split.take(&v, r)?);
            if spoil == 0 && r == ranks - 1 {
                ql = Tensor::from_f32(
                    &[batch, heads + 1, local, 8],
                    vec![0.5; batch * (heads + 1) * local * 8],
                )?;
            }
            if spoil == 1 {
                ql = Tensor::from_f32(ql.shape(), ql.to_f32_vec())?;
            }
            let out = cp.forward(&variant, [&ql, &kl, &vl], p0, Learned::none())?;
            let x = HeadsBackward {
                q: &ql,
                k: &kl,
                v: &vl,
                out: &out.out,
                lse: &out.lse,
                dout: &split.take(&dout, r)?,
                position_offset: p0,
            };
            let g = cp.backward(&variant, &x, Learned::none())?;
            Ok::<_, RuntimeError>((split, out, g))
        });
        if results.iter().all(Result::is_ok) {
            answered += 1;
            let results: Vec<_> = results.into_iter().map(Result::unwrap).collect();
            let split = results[0].0;
            let put = |f: &dyn Fn(&(_, Output, HeadGradients)) -> Tensor| {
                split
                    .put(&results.iter().map(f).collect::<Vec<_>>())
                    .unwrap()
            };
            let want = cpu
                .forward(&variant, Inputs::heads(&q, &k, &v), p0)
                .unwrap();
            let x = HeadsBackward {
                q: &q,
                k: &k,
                v: &v,
                out: &want.out,
                lse: &want.lse,
                dout: &dout,
                position_offset: p0,
            };
            let wg = cpu
                .backward(&variant, &BackwardInputs::Heads(x))
                .unwrap()
                .heads()
                .unwrap();
            let tol = if spec.dtype == attn_dsl::DType::F32 {
                1e-5
            } else {
                3e-2
            };
            let at = format!("case {case}: {text}, {scheme:?} on {ranks}");
            close(
                &format!("{at} out"),
                &put(&|r| r.1.out.clone()),
                &want.out,
                tol,
            );
            close(&format!("{at} dq"), &put(&|r| r.2.dq.clone()), &wg.dq, tol);
            close(&format!("{at} dk"), &put(&|r| r.2.dk.clone()), &wg.dk, tol);
        } else {
            refused += 1;
            for e in results.into_iter().filter_map(Result::err) {
                assert!(!e.to_string().is_empty(), "case {case}: an empty error");
            }
        }
    }
    assert!(
        answered >= 30 && refused >= 15,
        "{answered} answered, {refused} refused"
    );
}
