//! Quick start: declare attention variants, read their costs, and compute what they mean.
//!
//! Run with `cargo run --release --example quickstart`.

use attn::accounting::{forward_flops, kv_cache_bytes_per_token};
use attn::prelude::*;
use attn::reference::{self, Array};

/// A Llama-3-8B-shaped attention layer, declared (and validated) at compile time.
#[attention(
    heads = 32, kv_heads = 8, head_dim = 128, mask = causal, dtype = bf16,
    position = rope(base = 500000.0, scaling = llama3(factor = 8.0, low_freq_factor = 1.0,
                    high_freq_factor = 4.0, original_max_position = 8192))
)]
struct Llama3Attention;

/// Small deterministic pseudo-random inputs, as float64 arrays for the reference.
fn inputs(shape: &[usize], seed: u64) -> Array {
    let n = shape.iter().product();
    Array::from_vec(shape, attn::inputs::values_f64(n, seed)).expect("the values fill the shape")
}

fn main() {
    let llama = Llama3Attention::spec();
    println!("Llama-3 attention (from #[attention]):\n  {llama}");
    println!(
        "  KV cache: {} bytes per token per layer",
        kv_cache_bytes_per_token(llama)
    );

    let mla: AttentionSpec = "heads = 128, head_dim = 128, mla(latent_rank = 512, rope_dim = 64), \
                              mask = causal, dtype = bf16"
        .parse()
        .expect("a valid spec");
    println!("\nDeepSeek-V3-shaped MLA:\n  {mla}");
    println!(
        "  KV cache: {} bytes per token per layer",
        kv_cache_bytes_per_token(&mla)
    );

    // A custom variant: ALiBi with a soft cap and a custom distance penalty, compiled for this
    // CPU and checked against the reference semantics.
    let spec: AttentionSpec = "heads = 4, kv_heads = 2, head_dim = 64, mask = sliding_window(100), \
                               position = alibi, softcap = 20.0, \
                               score_mod = |score, b, h, q, k| score - 0.1 * ((q - k) as f32).sqrt()"
        .parse()
        .expect("a valid spec");
    let (b, sq, skv) = (1, 200, 300);
    let (q, k, v) = (
        inputs(&[b, 4, sq, 64], 1),
        inputs(&[b, 2, skv, 64], 2),
        inputs(&[b, 2, skv, 64], 3),
    );
    let tensor = |a: &Array| {
        let values = a.data().iter().map(|x| *x as f32).collect();
        Tensor::from_f32(a.shape(), values).expect("shape matches data")
    };
    // A variant is the spec validated and planned once (`shared`: the process's one for this
    // spec); a backend compiles its kernels on first use (here, ahead of the call, to time it).
    let variant = Variant::shared(&spec).expect("a valid spec");
    let backend = CpuBackend::new();
    let kernel = backend.forward_kernel(&spec).expect("compiles");
    let (qt, kt, vt) = (tensor(&q), tensor(&k), tensor(&v));
    let got = backend
        .forward(&variant, Inputs::heads(&qt, &kt, &vt), 0)
        .expect("shapes match the spec");
    let want = reference::attention(
        &spec,
        &reference::Inputs {
            q: &q,
            k: &k,
            v: &v,
            position_offset: 0,
        },
    )
    .expect("shapes match the spec");
    let max_err = got
        .out
        .to_f32_vec()
        .iter()
        .zip(want.out.data())
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0.0, f64::max);
    let flops = forward_flops(&spec, b as u64, sq as u64, skv as u64).expect("small shapes fit");
    println!("\nCustom variant:\n  {spec}");
    println!(
        "  kernel compiled in {:.2} ms ({:?} microkernels); {} FLOPs with masked pairs skipped",
        kernel.compile_time.as_secs_f64() * 1e3,
        backend.isa(),
        flops.with_skipping
    );
    println!("  max |kernel - reference| over the output: {max_err:.2e}");

    // Errors point at the offending tokens and say what is allowed.
    let bad = "heads = 32, kv_heads = 5, head_dim = 128";
    let errors = bad
        .parse::<AttentionSpec>()
        .expect_err("32 is not a multiple of 5");
    println!("\nAn invalid spec:\n{}", errors.render(bad));
}
