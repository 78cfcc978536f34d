//! Helpers shared by the integration tests: input values, and the `Backend` calls on a spec
//! (the process's shared variant of it) in the forms the tests read best. Each test binary uses
//! some of them.
#![allow(dead_code)]

use attn_dsl::AttentionSpec;
use attn_runtime::cache::{KvCache, SeqId};
use attn_runtime::{
    Backend, BackwardInputs, DecodeOptions, HeadGradients, HeadsBackward, Inputs, MlaQueries,
    MlaTensors, Output, Queries, RuntimeError, Tensor, Variant,
};

pub use attn_runtime::inputs::values;

fn variant(spec: &AttentionSpec) -> Result<std::sync::Arc<Variant>, RuntimeError> {
    Variant::shared(spec)
}

/// A per-head forward.
pub fn forward(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    position_offset: i64,
) -> Result<Output, RuntimeError> {
    backend.forward(&*variant(spec)?, Inputs::heads(q, k, v), position_offset)
}

/// An MLA forward.
pub fn forward_mla(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    x: &MlaTensors,
    position_offset: i64,
) -> Result<Output, RuntimeError> {
    backend.forward(&*variant(spec)?, Inputs::Mla(*x), position_offset)
}

/// Uniform queries against cached sequences.
pub fn decode(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    q: &Tensor,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
) -> Result<Output, RuntimeError> {
    backend.attend_cached(&*variant(spec)?, Queries::Uniform(q), cache, seqs, options)
}

/// MLA queries against a latent cache.
pub fn decode_mla(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    queries: MlaQueries,
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
) -> Result<Output, RuntimeError> {
    backend.attend_cached(
        &*variant(spec)?,
        Queries::Mla(queries),
        cache,
        seqs,
        options,
    )
}

/// A ragged batch against cached sequences.
pub fn attend_ragged(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    q: &Tensor,
    offsets: &[usize],
    cache: &dyn KvCache,
    seqs: &[SeqId],
    options: DecodeOptions,
) -> Result<Output, RuntimeError> {
    let queries = Queries::Ragged { q, offsets };
    backend.attend_cached(&*variant(spec)?, queries, cache, seqs, options)
}

/// A per-head backward.
pub fn backward(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    x: &HeadsBackward,
) -> Result<HeadGradients, RuntimeError> {
    backend
        .backward(&*variant(spec)?, &BackwardInputs::Heads(*x))?
        .heads()
}

/// An MLA backward.
pub fn backward_mla(
    backend: &dyn Backend,
    spec: &AttentionSpec,
    x: &attn_runtime::MlaBackward,
) -> Result<attn_runtime::MlaGradients, RuntimeError> {
    backend
        .backward(&*variant(spec)?, &BackwardInputs::Mla(*x))?
        .mla()
}
