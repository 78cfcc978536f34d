//! How a backward call's (batch, kv head) units become tasks: whole units, or units whose key
//! tiles are dealt to several tasks with private gradients summed afterwards, and the
//! parameters' gradients summed in an order that depends on the call's shape alone.

use crate::memory::written_zeros;
use rayon::prelude::*;

/// Gradients as f32 BHSD arrays: dq, dk, dv; and the parameters' gradients, laid out as the
/// parameters.
pub(super) type Grads = ((Vec<f32>, Vec<f32>, Vec<f32>), Vec<f32>);

/// Runs a task: (unit, split, [dq, dk, dv, parameter sums]).
pub(super) type RunTask<'a> = dyn Fn(usize, usize, [&mut [f32]; 4]) + Sync + 'a;

/// Values per (batch, kv head) unit of dq (its group's heads), dk and dv, and the parameters.
#[derive(Clone, Copy)]
pub(super) struct Lens {
    /// dq values of the unit's group of query heads.
    pub q: usize,
    /// dk values of its kv head.
    pub k: usize,
    /// dv values of its kv head.
    pub v: usize,
    /// The parameters' gradients (and data values) of the call.
    pub params: usize,
}

/// One task per unit, each writing its own rows of dq, dk and dv (no parameters).
pub(super) fn whole_units(((dq, dk, dv), _): &mut Grads, lens: Lens, run_task: &RunTask) {
    dq.par_chunks_mut(lens.q)
        .zip(dk.par_chunks_mut(lens.k))
        .zip(dv.par_chunks_mut(lens.v))
        .enumerate()
        .for_each(|(unit, ((dq, dk), dv))| run_task(unit, 0, [dq, dk, dv, &mut []]));
}

/// One task per unit, as [`whole_units`], each also summing the parameters' gradients
/// privately; the sums are added in unit order. Units run in chunks whose private sums fit
/// [`MAX_SPLIT_VALUES`]; the order of additions is that of a single chunk, so the result does
/// not depend on the chunk size either.
pub(super) fn whole_units_summing_params(
    ((dq, dk, dv), dparams): &mut Grads,
    lens: Lens,
    units: usize,
    run_task: &RunTask,
) {
    let chunk = (MAX_SPLIT_VALUES / lens.params).max(1);
    for start in (0..units).step_by(chunk) {
        let end = (start + chunk).min(units);
        let sums: Vec<Vec<f32>> = dq[start * lens.q..end * lens.q]
            .par_chunks_mut(lens.q)
            .zip(dk[start * lens.k..end * lens.k].par_chunks_mut(lens.k))
            .zip(dv[start * lens.v..end * lens.v].par_chunks_mut(lens.v))
            .enumerate()
            .map(|(i, ((dq, dk), dv))| {
                let mut sums = vec![0f32; lens.params];
                run_task(start + i, 0, [dq, dk, dv, &mut sums]);
                sums
            })
            .collect();
        for unit_sums in &sums {
            dparams.iter_mut().zip(unit_sums).for_each(|(t, x)| *t += x);
        }
    }
}

/// Few units for the threads: each unit's key tiles are dealt round-robin to `splits` tasks
/// (round-robin keeps causal work even), each with its own gradients, summed afterwards (a
/// split's dk and dv rows are zero outside its tiles); the parameters' sums in task order.
pub(super) fn split_units(
    ((dq, dk, dv), dparams): &mut Grads,
    lens: Lens,
    units: usize,
    splits: usize,
    run_task: &RunTask,
) {
    let Lens { q, k, v, params } = lens;
    let partial: Vec<Vec<f32>> = (0..units * splits)
        .into_par_iter()
        .map(|i| {
            let mut grads = written_zeros(q + k + v + params);
            let (dq, rest) = grads.split_at_mut(q);
            let (dk, rest) = rest.split_at_mut(k);
            let (dv, sums) = rest.split_at_mut(v);
            run_task(i / splits, i % splits, [dq, dk, dv, sums]);
            grads
        })
        .collect();
    dq.par_chunks_mut(q)
        .zip(dk.par_chunks_mut(k))
        .zip(dv.par_chunks_mut(v))
        .zip(partial.par_chunks(splits))
        .for_each(|(((dq, dk), dv), parts)| {
            for part in parts {
                let (pq, rest) = part.split_at(q);
                let (pk, rest) = rest.split_at(k);
                let pv = &rest[..v];
                for (out, add) in [(&mut *dq, pq), (&mut *dk, pk), (&mut *dv, pv)] {
                    out.iter_mut().zip(add).for_each(|(o, a)| *o += a);
                }
            }
        });
    for part in &partial {
        let sums = &part[q + k + v..];
        dparams.iter_mut().zip(sums).for_each(|(t, x)| *t += x);
    }
}

/// Most values of private gradients the split tasks of one call may hold together.
pub(super) const MAX_SPLIT_VALUES: usize = 64 << 20;

/// How many tasks share each (batch, kv head)'s key tiles: 1 when the units alone keep every
/// thread busy, else enough for two tasks per thread, as far as there are tiles to deal and the
/// private gradients (`unit_values` each) stay within [`MAX_SPLIT_VALUES`].
pub(super) fn key_splits(units: usize, tiles: usize, unit_values: usize) -> usize {
    let wanted = 2 * rayon::current_num_threads();
    if units >= wanted {
        return 1;
    }
    let by_memory = MAX_SPLIT_VALUES / (units * unit_values).max(1);
    wanted.div_ceil(units).min(tiles).min(by_memory).max(1)
}

/// Tasks a call with parameters aims for: enough to keep a few threads busy however few
/// (batch, kv head) units it has, fixed so that the tasks (and the order in which the parameter
/// gradients add up) do not depend on the thread count.
pub(super) const FIXED_TASKS: usize = 16;

/// [`key_splits`] for a call with parameters: [`FIXED_TASKS`] in place of the thread count.
pub(super) fn fixed_splits(units: usize, tiles: usize, unit_values: usize) -> usize {
    if units >= FIXED_TASKS {
        return 1;
    }
    let by_memory = MAX_SPLIT_VALUES / (units * unit_values).max(1);
    FIXED_TASKS.div_ceil(units).min(tiles).min(by_memory).max(1)
}
