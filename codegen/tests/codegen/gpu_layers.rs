//! The decoder's non-attention kernels (GPU IR), verified and run on the interpreter against
//! the same maths in f64: RMSNorm, LayerNorm, SwiGLU, GELU, residual adds, embedding lookups
//! (f32 and bf16 tables) and the argmax greedy decoding takes.

use codegen::gpu::interp::{Memory, Val, run};
use codegen::gpu::ir::verify::verify;
use codegen::gpu::ir::{Half, Kernel};
use codegen::gpu::kernels::layers::{
    self, Activation, ArgmaxArgs, ColumnsArgs, ElementwiseArgs, EmbedArgs, NormArgs, Pointwise,
    RowNorm, ScatterArgs, SinkArgs, THREADS,
};
use codegen::gpu::launch::{LaunchRecord, bind};

/// Values in [-2, 2) from a seed.
fn values(n: usize, seed: u64) -> Vec<f32> {
    attn_dsl::inputs::values(n, seed)
        .into_iter()
        .map(|x| 2.0 * x)
        .collect()
}

fn launch<R: LaunchRecord>(kernel: &Kernel, grid: u32, record: &R, mem: &mut Memory) {
    verify(kernel).unwrap_or_else(|e| panic!("{}: {e:?}", kernel.name));
    let args: Vec<Val> = bind(kernel, record)
        .unwrap()
        .into_iter()
        .map(Val::I64)
        .collect();
    run(kernel, [grid, 1, 1], &args, mem).unwrap_or_else(|e| panic!("{}: {e}", kernel.name));
}

fn close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn norms_match_their_definitions() {
    // (kind, width, bias, weight rows): one row of weights for every row, or rows of weights
    // repeating down the rows (cohere's per-head q/k norms).
    for (kind, width, with_bias, weight_rows) in [
        (RowNorm::Rms, 300, false, 1),
        (RowNorm::Rms, 64, false, 1),
        (RowNorm::Layer, 1000, true, 1),
        (RowNorm::Layer, 33, false, 1),
        (RowNorm::Layer, 16, false, 3),
        (RowNorm::Rms, 24, true, 2),
    ] {
        let (rows, eps) = (6, 1e-5f32);
        let x = values(rows * width, 1);
        let (w, b) = (
            values(weight_rows * width, 2),
            values(weight_rows * width, 3),
        );
        let mut mem = Memory::default();
        let record = NormArgs {
            x: mem.alloc_f32(&x),
            weight: mem.alloc_f32(&w),
            bias: mem.alloc_f32(&b),
            out: mem.alloc_f32(&vec![0.0; rows * width]),
        };
        let kernel = layers::norm(kind, width as u32, eps, with_bias, weight_rows as u32);
        launch(&kernel, rows as u32, &record, &mut mem);
        let got = mem.read_f32(record.out, rows * width).unwrap();
        let mut want = Vec::new();
        for (r, row) in x.chunks(width).enumerate() {
            let row: Vec<f64> = row.iter().map(|v| f64::from(*v)).collect();
            let mean = match kind {
                RowNorm::Rms => 0.0,
                RowNorm::Layer => row.iter().sum::<f64>() / width as f64,
            };
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / width as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            let w0 = (r % weight_rows) * width;
            for (i, v) in row.iter().enumerate() {
                let bias = if with_bias { f64::from(b[w0 + i]) } else { 0.0 };
                want.push((v - mean) * inv * f64::from(w[w0 + i]) + bias);
            }
        }
        close(
            &got,
            &want,
            2e-5,
            &format!("{kind:?} width {width}, {weight_rows} weight rows"),
        );
    }
}

#[test]
fn activations_and_adds_match_their_definitions() {
    let count = 2 * THREADS as usize + 37;
    let grid = count.div_ceil(THREADS as usize) as u32;
    let (mut x, other) = (values(count, 4), values(count, 5));
    // Large inputs saturate the exponentials instead of turning into NaN.
    x[0] = 80.0;
    x[1] = -80.0;
    let gelu = |u: f64| {
        let y = (2.0 / std::f64::consts::PI).sqrt() * (u + 0.044715 * u.powi(3));
        0.5 * u * (1.0 + y.tanh())
    };
    let clamped = Activation::ClampedSwiGlu {
        alpha: 1.702f32.to_bits(),
        limit: 0.3f32.to_bits(),
    };
    for kind in [
        Activation::SwiGlu,
        Activation::Gelu,
        Activation::GeGlu,
        Activation::GeluExact,
        clamped,
    ] {
        let mut mem = Memory::default();
        let record = ElementwiseArgs {
            x: mem.alloc_f32(&x),
            other: mem.alloc_f32(&other),
            count: count as i64,
        };
        launch(&layers::activation(kind), grid, &record, &mut mem);
        let got = mem.read_f32(record.x, count).unwrap();
        let want: Vec<f64> = x
            .iter()
            .zip(&other)
            .map(|(&u, &g)| {
                let (u, g) = (f64::from(u), f64::from(g));
                match kind {
                    Activation::SwiGlu => u * g / (1.0 + (-g).exp()),
                    Activation::Gelu => gelu(u),
                    Activation::GeGlu => gelu(g) * u,
                    Activation::GeluExact => {
                        0.5 * u * (1.0 + libm::erf(u / std::f64::consts::SQRT_2))
                    }
                    Activation::ClampedSwiGlu { .. } => {
                        let g = g.min(0.3);
                        (u.clamp(-0.3, 0.3) + 1.0) * g / (1.0 + (-1.702 * g).exp())
                    }
                }
            })
            .collect();
        close(&got, &want, 1e-5, &format!("{kind:?}"));
    }
    let mut mem = Memory::default();
    let record = ElementwiseArgs {
        x: mem.alloc_f32(&x),
        other: mem.alloc_f32(&other),
        count: count as i64,
    };
    // Multipliers and the logit softcap, in place.
    for op in [Pointwise::Scale(-0.37), Pointwise::Softcap(3.0)] {
        let mut mem = Memory::default();
        let record = ElementwiseArgs {
            x: mem.alloc_f32(&x),
            other: 0,
            count: count as i64,
        };
        launch(&layers::pointwise(op), grid, &record, &mut mem);
        let got = mem.read_f32(record.x, count).unwrap();
        let want: Vec<f64> = x
            .iter()
            .map(|&v| match op {
                Pointwise::Scale(f) => f64::from(v) * f64::from(f),
                Pointwise::Softcap(c) => 3.0 * (f64::from(v) / f64::from(c)).tanh(),
            })
            .collect();
        close(&got, &want, 1e-6, &format!("{op:?}"));
    }
    launch(&layers::residual_add(), grid, &record, &mut mem);
    let got = mem.read_f32(record.x, count).unwrap();
    let want: Vec<f64> = x
        .iter()
        .zip(&other)
        .map(|(a, b)| f64::from(a + b))
        .collect();
    close(&got, &want, 0.0, "residual add");
}

/// A column range of rows lands at its offset in the swapped layout; the other output columns
/// keep their values.
#[test]
fn column_ranges_copy_across_layouts() {
    let (a, b, in_width, out_width) = (3usize, 4usize, 10usize, 7usize);
    let (in_first, out_first, width) = (6usize, 2usize, 4usize);
    let x = values(a * b * in_width, 10);
    let out = values(b * a * out_width, 11);
    let mut mem = Memory::default();
    let record = ColumnsArgs {
        x: mem.alloc_f32(&x),
        out: mem.alloc_f32(&out),
        a: a as i64,
        b: b as i64,
        in_width: in_width as i64,
        in_first: in_first as i64,
        out_width: out_width as i64,
        out_first: out_first as i64,
        width: width as i64,
    };
    let grid = (a * b * width).div_ceil(THREADS as usize) as u32;
    launch(&layers::columns(), grid, &record, &mut mem);
    let got = mem.read_f32(record.out, b * a * out_width).unwrap();
    let mut want: Vec<f64> = out.iter().map(|&v| f64::from(v)).collect();
    for i in 0..a {
        for j in 0..b {
            for c in 0..width {
                want[(j * a + i) * out_width + out_first + c] =
                    f64::from(x[(i * b + j) * in_width + in_first + c]);
            }
        }
    }
    close(&got, &want, 0.0, "columns");
}

/// Weighted rows add back into the rows they were gathered from; other rows keep their values.
#[test]
fn weighted_rows_scatter_back() {
    let (width, rows) = (37usize, 3usize);
    let out = values(5 * width, 8);
    let x = values(rows * width, 9);
    let (index, weights) = ([4i32, 0, 2], [0.5f32, -1.5, 2.0]);
    let mut mem = Memory::default();
    let index_bytes: Vec<u8> = index.iter().flat_map(|i| i.to_le_bytes()).collect();
    let record = ScatterArgs {
        out: mem.alloc_f32(&out),
        x: mem.alloc_f32(&x),
        index: mem.alloc_bytes(index_bytes),
        weights: mem.alloc_f32(&weights),
        rows: rows as i64,
        width: width as i64,
    };
    let grid = (rows * width).div_ceil(THREADS as usize) as u32;
    launch(&layers::scatter_add_rows(), grid, &record, &mut mem);
    let got = mem.read_f32(record.out, 5 * width).unwrap();
    let mut want: Vec<f64> = out.iter().map(|&v| f64::from(v)).collect();
    for (r, (&i, &w)) in index.iter().zip(&weights).enumerate() {
        for c in 0..width {
            want[i as usize * width + c] += f64::from(w) * f64::from(x[r * width + c]);
        }
    }
    close(&got, &want, 1e-6, "scatter");
}

/// Sinks scale each row by `e^lse / (e^lse + e^sink)` of the row's head, for head-major and
/// token-major rows; an empty row (`lse = -inf`) stays 0.
#[test]
fn sinks_scale_rows_by_their_heads_share() {
    let (heads, tokens, width) = (3usize, 5usize, 7usize);
    let rows = heads * tokens;
    let out = values(rows * width, 6);
    let mut lse = values(rows, 7);
    lse[4] = f32::NEG_INFINITY;
    let sinks = [0.5f32, -1.25, 2.0];
    for (per_head, head_of) in [
        (
            tokens,
            Box::new(|r: usize| r / tokens) as Box<dyn Fn(usize) -> usize>,
        ),
        (1, Box::new(|r: usize| r % heads)),
    ] {
        let mut mem = Memory::default();
        let record = SinkArgs {
            out: mem.alloc_f32(&out),
            lse: mem.alloc_f32(&lse),
            sinks: mem.alloc_f32(&sinks),
            count: (rows * width) as i64,
            width: width as i64,
            per_head: per_head as i64,
            heads: heads as i64,
        };
        let grid = (rows * width).div_ceil(THREADS as usize) as u32;
        launch(&layers::sink_rows(), grid, &record, &mut mem);
        let got = mem.read_f32(record.out, rows * width).unwrap();
        let want: Vec<f64> = (0..rows * width)
            .map(|e| {
                let r = e / width;
                let (l, s) = (f64::from(lse[r]), f64::from(sinks[head_of(r)]));
                let keep = if l == f64::NEG_INFINITY {
                    0.0
                } else {
                    l.exp() / (l.exp() + s.exp())
                };
                f64::from(out[e]) * keep
            })
            .collect();
        close(
            &got,
            &want,
            1e-6,
            &format!("sinks, {per_head} rows per head"),
        );
    }
}

#[test]
fn embeddings_look_up_rows_of_f32_and_bf16_tables() {
    let (vocab, width) = (50, 300);
    let table = values(vocab * width, 6);
    let tokens: Vec<i32> = vec![3, 0, 49, 3];
    for half in [None, Some(Half::Bf16), Some(Half::F16)] {
        let mut mem = Memory::default();
        let bytes: Vec<u8> = match half {
            None => table.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Some(Half::Bf16) => table
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Some(Half::F16) => table
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        let record = EmbedArgs {
            tokens: mem.alloc_bytes(tokens.iter().flat_map(|t| t.to_le_bytes()).collect()),
            table: mem.alloc_bytes(bytes),
            out: mem.alloc_f32(&vec![0.0; tokens.len() * width]),
        };
        launch(
            &layers::embed(width as u32, half),
            tokens.len() as u32,
            &record,
            &mut mem,
        );
        let got = mem.read_f32(record.out, tokens.len() * width).unwrap();
        let want: Vec<f64> = tokens
            .iter()
            .flat_map(|&t| table[t as usize * width..(t as usize + 1) * width].to_vec())
            .map(|v| match half {
                None => f64::from(v),
                Some(Half::Bf16) => f64::from(half::bf16::from_f32(v).to_f32()),
                Some(Half::F16) => f64::from(half::f16::from_f32(v).to_f32()),
            })
            .collect();
        close(&got, &want, 0.0, &format!("embed {half:?}"));
    }
}

#[test]
fn argmax_takes_the_first_largest_value_of_each_row() {
    let width = 1000;
    let mut rows = [
        values(width, 7),
        values(width, 8),
        vec![-1.0; width],
        values(width, 9),
        vec![f32::NAN; width],
    ];
    // Ties go to the first index; NaN is never chosen over a number.
    rows[1][700] = 5.0;
    rows[1][900] = 5.0;
    rows[2][0] = f32::NAN;
    rows[3][999] = 7.0;
    let x: Vec<f32> = rows.concat();
    let mut mem = Memory::default();
    let record = ArgmaxArgs {
        x: mem.alloc_f32(&x),
        out: mem.alloc_bytes(vec![0; 4 * rows.len()]),
    };
    launch(
        &layers::argmax(width as u32),
        rows.len() as u32,
        &record,
        &mut mem,
    );
    let got: Vec<i32> = mem
        .read_f32(record.out, rows.len())
        .unwrap()
        .iter()
        .map(|v| v.to_bits() as i32)
        .collect();
    let first_max = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(
                (layers::NO_CHOICE as usize, f32::NEG_INFINITY),
                |(bi, bv), (i, &v)| {
                    if v > bv { (i, v) } else { (bi, bv) }
                },
            )
            .0 as i32
    };
    let want: Vec<i32> = rows.iter().map(|r| first_max(r)).collect();
    assert_eq!(want[1], 700);
    assert_eq!(want[2], 1);
    assert_eq!(want[3], 999);
    // A row of NaN chooses nothing, rather than token 0.
    assert_eq!(want[4], i32::MAX);
    assert_eq!(got, want);
}

#[test]
fn outer_axes_swap_into_f32_and_packed_halves() {
    use codegen::gpu::kernels::layers::SwapArgs;
    let (a, b, width) = (5usize, 3usize, 6usize);
    let x = values(a * b * width, 10);
    let want: Vec<f32> = (0..b)
        .flat_map(|ib| (0..a).map(move |ia| (ia, ib)))
        .flat_map(|(ia, ib)| x[(ia * b + ib) * width..(ia * b + ib + 1) * width].to_vec())
        .collect();
    for out in [None, Some(Half::Bf16), Some(Half::F16)] {
        let size = if out.is_some() { 2 } else { 4 };
        let per = if out.is_some() { 2 } else { 1 };
        let mut mem = Memory::default();
        let record = SwapArgs {
            x: mem.alloc_f32(&x),
            out: mem.alloc_bytes(vec![0; size * x.len()]),
            a: a as i64,
            b: b as i64,
            width: width as i64,
        };
        let grid = (x.len() / per).div_ceil(THREADS as usize) as u32;
        launch(&layers::swap_outer(out), grid, &record, &mut mem);
        let got: Vec<f32> = match out {
            None => mem.read_f32(record.out, x.len()).unwrap(),
            Some(half) => mem
                .read_f32(record.out, x.len() / 2)
                .unwrap()
                .iter()
                .flat_map(|w| {
                    let bits = w.to_bits();
                    [bits as u16, (bits >> 16) as u16]
                })
                .map(|h| match half {
                    Half::Bf16 => half::bf16::from_bits(h).to_f32(),
                    Half::F16 => half::f16::from_bits(h).to_f32(),
                })
                .collect(),
        };
        let rounded: Vec<f64> = want
            .iter()
            .map(|&v| match out {
                None => f64::from(v),
                Some(Half::Bf16) => f64::from(half::bf16::from_f32(v).to_f32()),
                Some(Half::F16) => f64::from(half::f16::from_f32(v).to_f32()),
            })
            .collect();
        close(&got, &rounded, 0.0, &format!("swap {out:?}"));
    }
}

#[test]
fn biases_add_to_every_row() {
    use codegen::gpu::kernels::layers::BiasArgs;
    let (rows, width) = (7, 40);
    let (x, bias) = (values(rows * width, 11), values(width, 12));
    let mut mem = Memory::default();
    let record = BiasArgs {
        x: mem.alloc_f32(&x),
        bias: mem.alloc_f32(&bias),
        count: (rows * width) as i64,
        width: width as i64,
    };
    launch(&layers::bias_add(), 2, &record, &mut mem);
    let got = mem.read_f32(record.x, rows * width).unwrap();
    let want: Vec<f64> = x
        .iter()
        .enumerate()
        .map(|(i, v)| f64::from(v + bias[i % width]))
        .collect();
    close(&got, &want, 0.0, "bias");
}

/// Rows appended to a head-major cache: rotated inside the RoPE columns (both pairings), as
/// `(a cos - b sin, b cos + a sin)`, stored as f32 or bf16, at the cache's slots from `pos0`.
#[test]
fn cache_appends_rotate_and_store_rows() {
    use attn_dsl::RopeLayout;
    use codegen::gpu::kernels::layers::{AppendArgs, AppendRope};
    let (tokens, kv_heads, width, capacity, pos0) = (3usize, 2usize, 12usize, 8usize, 4usize);
    let rows = values(tokens * kv_heads * width, 13);
    let rope = AppendRope {
        dim: 8,
        first_dim: 2,
        layout: RopeLayout::Half,
    };
    let half = rope.dim as usize / 2;
    let (cos, sin) = (values(tokens * half, 14), values(tokens * half, 15));
    for (layout, dtype) in [
        (Some(RopeLayout::Half), None),
        (Some(RopeLayout::Interleaved), Some(Half::Bf16)),
        (None, Some(Half::F16)),
        (None, None),
    ] {
        let rope = layout.map(|layout| AppendRope { layout, ..rope });
        let size = if dtype.is_some() { 2 } else { 4 };
        let mut mem = Memory::default();
        let record = AppendArgs {
            rows: mem.alloc_f32(&rows),
            cache: mem.alloc_bytes(vec![0; size * kv_heads * capacity * width]),
            tokens: tokens as i64,
            kv_heads: kv_heads as i64,
            capacity: capacity as i64,
            pos0: pos0 as i64,
            rope_cos: mem.alloc_f32(&cos),
            rope_sin: mem.alloc_f32(&sin),
        };
        let per = if dtype.is_some() { 2 } else { 1 };
        let grid = (tokens * kv_heads * width / per).div_ceil(THREADS as usize) as u32;
        launch(
            &layers::cache_append(width as u32, dtype, rope),
            grid,
            &record,
            &mut mem,
        );
        let stored = mem
            .read_bytes(record.cache, size * kv_heads * capacity * width)
            .unwrap();
        let value = |i: usize| -> f32 {
            match dtype {
                None => f32::from_le_bytes(stored[4 * i..4 * i + 4].try_into().unwrap()),
                Some(Half::Bf16) => {
                    half::bf16::from_le_bytes([stored[2 * i], stored[2 * i + 1]]).to_f32()
                }
                Some(Half::F16) => {
                    half::f16::from_le_bytes([stored[2 * i], stored[2 * i + 1]]).to_f32()
                }
            }
        };
        let round = |v: f32| match dtype {
            None => v,
            Some(Half::Bf16) => half::bf16::from_f32(v).to_f32(),
            Some(Half::F16) => half::f16::from_f32(v).to_f32(),
        };
        for t in 0..tokens {
            for h in 0..kv_heads {
                let mut want =
                    rows[(t * kv_heads + h) * width..(t * kv_heads + h + 1) * width].to_vec();
                if let Some(r) = rope {
                    let src = want.clone();
                    for j in 0..half {
                        let (a, b) = match r.layout {
                            RopeLayout::Half => (2 + j, 2 + j + half),
                            RopeLayout::Interleaved => (2 + 2 * j, 2 + 2 * j + 1),
                        };
                        let (c, s) = (cos[t * half + j], sin[t * half + j]);
                        want[a] = src[a] * c - src[b] * s;
                        want[b] = src[b] * c + src[a] * s;
                    }
                }
                for (col, w) in want.iter().enumerate() {
                    let got = value((h * capacity + pos0 + t) * width + col);
                    assert_eq!(
                        got,
                        round(*w),
                        "{layout:?} {dtype:?} token {t} head {h} col {col}"
                    );
                }
            }
        }
        // Slots before pos0 are untouched.
        assert_eq!(value(0), 0.0);
    }
}

#[test]
fn rows_gather_by_index() {
    use codegen::gpu::kernels::layers::GatherArgs;
    let width = 5;
    let x = values(4 * width, 16);
    let index: Vec<i32> = vec![2, 2, 0, 3, 1, 2];
    let mut mem = Memory::default();
    let record = GatherArgs {
        x: mem.alloc_f32(&x),
        index: mem.alloc_bytes(index.iter().flat_map(|i| i.to_le_bytes()).collect()),
        out: mem.alloc_f32(&vec![0.0; index.len() * width]),
        rows: index.len() as i64,
        width: width as i64,
    };
    launch(&layers::gather_rows(), 1, &record, &mut mem);
    let got = mem.read_f32(record.out, index.len() * width).unwrap();
    let want: Vec<f64> = index
        .iter()
        .flat_map(|&i| x[i as usize * width..(i as usize + 1) * width].to_vec())
        .map(f64::from)
        .collect();
    close(&got, &want, 0.0, "gather");
}

/// Split-KV partitions merged on the device as the host merges them: weights `e^(l - max l)`,
/// rows without a kept key 0, NaN parts NaN; with `sums` (sigmoid attention) the parts add.
#[test]
fn partitions_merge_by_their_lse() {
    for sums in [false, true] {
        merge_partitions_case(sums);
    }
}

fn merge_partitions_case(sums: bool) {
    use codegen::gpu::kernels::layers::MergeArgs;
    let width = 6;
    let parts = values(7 * width, 17);
    let lse = [
        0.5f32,
        -1.0,
        f32::NEG_INFINITY,
        2.0,
        f32::NAN,
        0.0,
        f32::NEG_INFINITY,
    ];
    // Output rows: parts {0, 1, 3}, {2} (no key anywhere), {4, 5} (NaN), {5, 6}.
    let map: Vec<i32> = vec![0, 1, 3, 2, -1, -1, 4, 5, -1, 5, 6, -1];
    let (rows, slots) = (4, 3);
    let mut mem = Memory::default();
    let record = MergeArgs {
        parts: mem.alloc_f32(&parts),
        lse: mem.alloc_f32(&lse),
        map: mem.alloc_bytes(map.iter().flat_map(|i| i.to_le_bytes()).collect()),
        out: mem.alloc_f32(&vec![1.0; rows * width]),
        out_lse: mem.alloc_f32(&vec![1.0; rows]),
        rows: rows as i64,
        slots: slots as i64,
        width: width as i64,
        sums: i64::from(sums),
    };
    launch(&layers::merge_partitions(), 1, &record, &mut mem);
    let got = mem.read_f32(record.out, rows * width).unwrap();
    let got_lse = mem.read_f32(record.out_lse, rows).unwrap();
    for r in 0..rows {
        let ps: Vec<usize> = map[r * slots..(r + 1) * slots]
            .iter()
            .filter(|p| **p >= 0)
            .map(|p| *p as usize)
            .collect();
        for c in 0..width {
            let g = got[r * width + c];
            if ps.iter().any(|&p| lse[p].is_nan()) {
                assert!(g.is_nan() && got_lse[r].is_nan(), "row {r}");
                continue;
            }
            let m = ps
                .iter()
                .map(|&p| f64::from(lse[p]))
                .fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                assert_eq!((g, got_lse[r]), (0.0, f32::NEG_INFINITY), "row {r}");
                continue;
            }
            let (mut total, mut acc, mut sum) = (0.0, 0.0, 0.0);
            for &p in &ps {
                let w = (f64::from(lse[p]) - m).exp();
                total += w;
                acc += w * f64::from(parts[p * width + c]);
                sum += f64::from(parts[p * width + c]);
            }
            let want = if sums { sum } else { acc / total };
            close(
                &[g],
                &[want],
                1e-5,
                &format!("row {r} col {c} (sums {sums})"),
            );
            close(
                &[got_lse[r]],
                &[m + total.ln()],
                1e-5,
                &format!("lse of row {r}"),
            );
        }
    }
}
