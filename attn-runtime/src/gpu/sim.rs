//! The `gpu-sim` backend: the GPU kernels run on codegen's GPU IR interpreter with the launches
//! a device would get, so the runtime's GPU path is tested without a GPU. Each call's cost is
//! estimated first ([`super::sim_cost`]) and one the interpreter would spend minutes on is
//! refused.

use super::sim_cost;
use crate::backend::Backend;
use crate::cache::{KvCache, SeqId};
use crate::calls::{BackwardInputs, DecodeOptions, Gradients, Inputs, Output, Queries};
use crate::error::RuntimeError;
use crate::tensor::Tensor;
use crate::variant::Variant;

/// The GPU kernels on the GPU IR interpreter.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuSim;

impl Backend for GpuSim {
    fn name(&self) -> &'static str {
        "gpu-sim"
    }

    fn forward_bound(
        &self,
        variant: &Variant,
        inputs: Inputs,
        position_offset: i64,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        let spec = variant.spec();
        match inputs {
            Inputs::Heads { q, k, v } => {
                let [b, _, sq, skv] = bhss(q, k);
                let seconds = sim_cost::attention_seconds(spec, b, sq, skv, false);
                sim_cost::check("this forward", seconds)?;
                super::GpuCall::forward_in(variant, q, k, v, position_offset)?
                    .with_params(params)?
                    .run_on_sim()
            }
            Inputs::Mla(x) => {
                let (b, sq, skv) = (dim(x.q_nope, 0), dim(x.q_nope, 2), dim(x.c_kv, 1));
                let seconds = sim_cost::attention_seconds(spec, b, sq, skv, false);
                sim_cost::check("this forward", seconds)?;
                super::forward_mla_on_sim(variant, &x, position_offset)
            }
        }
    }

    fn attend_cached_bound(
        &self,
        variant: &Variant,
        queries: Queries,
        cache: &dyn KvCache,
        seqs: &[SeqId],
        options: DecodeOptions,
        params: &[f32],
    ) -> Result<Output, RuntimeError> {
        let run = &|l: &super::decode::DecodeLaunch| l.run_on_sim(params);
        match queries {
            Queries::Uniform(q) => {
                let q_len = dim(q, 2);
                check_cached(variant, cache, seqs.iter().map(|&s| (s, q_len)))?;
                super::decode::decode_with(variant, q, cache, seqs, options, run)
            }
            Queries::Ragged { q, offsets } => {
                let counts = offsets.windows(2).map(|w| w[1].saturating_sub(w[0]) as u64);
                check_cached(variant, cache, seqs.iter().copied().zip(counts))?;
                super::decode::attend_ragged_with(variant, q, offsets, cache, seqs, options, run)
            }
            Queries::Mla(queries) => {
                let q_len = dim(queries.q_nope, 2);
                check_cached(variant, cache, seqs.iter().map(|&s| (s, q_len)))?;
                super::decode::decode_mla_with(variant, queries, cache, seqs, options, run)
            }
        }
    }

    fn backward_bound(
        &self,
        variant: &Variant,
        x: &BackwardInputs,
        params: &[f32],
    ) -> Result<(Gradients, Vec<f32>), RuntimeError> {
        match x {
            BackwardInputs::Heads(x) => {
                let [b, _, sq, skv] = bhss(x.q, x.k);
                let seconds = sim_cost::attention_seconds(variant.spec(), b, sq, skv, true);
                sim_cost::check("this forward and backward", seconds)?;
                super::backward::backward_on_sim(variant, x, params)
                    .map(|(g, dparams)| (Gradients::Heads(g), dparams))
            }
            BackwardInputs::Mla(_) => Err(RuntimeError::Unsupported {
                backend: "gpu-sim",
                what: "the MLA backward (the cpu backend does)".into(),
            }),
        }
    }
}

/// Dim `i` of `t`, 0 where it has fewer (the call's own checks refuse it after).
fn dim(t: &Tensor, i: usize) -> u64 {
    t.shape().get(i).map_or(0, |&d| d as u64)
}

/// `[batch, heads, queries, keys]` of q `[B, H, Sq, D]` and k `[B, Hkv, Skv, D]`.
fn bhss(q: &Tensor, k: &Tensor) -> [u64; 4] {
    [dim(q, 0), dim(q, 1), dim(q, 2), dim(k, 2)]
}

/// Refuses cached work on the interpreter (`(sequence, queries)` pairs against the cache) that
/// would take it too long.
fn check_cached(
    variant: &Variant,
    cache: &dyn KvCache,
    work: impl Iterator<Item = (SeqId, u64)>,
) -> Result<(), RuntimeError> {
    let seconds: f64 = work
        .map(|(seq, queries)| {
            let keys = cache.seq_len(seq).unwrap_or(0) as u64 + queries;
            sim_cost::attention_seconds(variant.spec(), 1, queries, keys, false)
        })
        .sum();
    sim_cost::check("this decode step", seconds)
}
