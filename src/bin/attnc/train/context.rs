//! `--context-parallel N`: the ranks split every window's positions instead of the batch, and
//! each attention of the model runs context-parallel over them (attn's Ulysses or ring).

use super::ranks::Ranks;
use super::state::Options;
use attn::distributed::{ContextParallel, Scheme};
use attn::{AttentionSpec, CpuBackend, Variant};

/// The ranks set to split each sequence of a run (`n` of them, as many as there are; `scheme`
/// as --scheme gives it), with this rank's positions: the split every attention kind of the
/// model (`kinds`) agrees on.
pub fn split_sequences(
    ranks: Option<Ranks>,
    (n, scheme): (u64, &str),
    kinds: &[AttentionSpec],
    options: &Options,
) -> Result<Ranks, String> {
    let size = ranks.as_ref().map_or(1, Ranks::size);
    let Some(ranks) = ranks.filter(|_| size as u64 == n) else {
        return Err(format!(
            "error: --context-parallel {n} splits each sequence over {n} ranks, but the run has \
             {size}: give --ranks {n} (or mpirun -n {n}); data and context parallelism together \
             are not supported yet"
        ));
    };
    let text = scheme;
    let scheme: Scheme = text.parse().map_err(|e| format!("error: --scheme: {e}"))?;
    let cpu = CpuBackend::new();
    let cp = ContextParallel::new(ranks.comm(), &cpu, scheme);
    let mut split = None;
    for spec in kinds {
        let variant = Variant::shared(spec).map_err(|e| format!("error: {e}"))?;
        let this = cp
            .split(&variant, options.seq)
            .map_err(|e| format!("error: --context-parallel {n} --seq {}: {e}", options.seq))?;
        if split.is_some_and(|s| s != this) {
            return Err(format!(
                "error: --context-parallel with --scheme {text}: the model's attention kinds \
                 split the sequence differently (causal and unmasked kinds); use --scheme \
                 ulysses"
            ));
        }
        split = Some(this);
    }
    let split = split.ok_or("error: the model has no attention")?;
    let positions = split
        .chunks(ranks.rank())
        .into_iter()
        .flatten()
        .map(|p| p as u32)
        .collect();
    Ok(ranks.splitting_sequences(scheme, positions))
}
