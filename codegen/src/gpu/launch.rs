//! Typed launch records: each kernel family's parameters as a struct with named fields. The
//! lowering takes its parameter list from the record, and launches bind a record to a kernel by
//! name ([`bind`]), so the host and the kernel cannot disagree on positions.

use super::ir::{Kernel, Ty};

/// What a parameter holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A device address in global memory (bytes).
    Address,
    /// An integer.
    Scalar,
}

/// One field of a launch record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    /// The field's (and the kernel parameter's) name.
    pub name: &'static str,
    /// What it holds.
    pub kind: ParamKind,
}

/// A kernel family's parameters as a record of 64-bit values (addresses and scalars are both
/// i64 in GPU IR).
pub trait LaunchRecord {
    /// The fields, in the order of the kernel's parameters.
    const FIELDS: &'static [Param];

    /// The field values, in [`LaunchRecord::FIELDS`] order.
    fn values(&self) -> Vec<i64>;

    /// The kernel parameters of the record: its field names, each an I64.
    fn params() -> Vec<(String, Ty)> {
        Self::FIELDS
            .iter()
            .map(|p| (p.name.to_string(), Ty::I64))
            .collect()
    }

    /// The position of field `name` among the kernel's parameters, for a lowering that refers
    /// to it (a name not in the record is a bug in the lowering).
    fn position(name: &str) -> u32 {
        Self::FIELDS
            .iter()
            .position(|p| p.name == name)
            .unwrap_or_else(|| panic!("`{name}` is not a field of the launch record"))
            as u32
    }
}

/// The argument values of a launch of `kernel` with `record`, in the kernel's parameter order;
/// an error when the kernel's parameters are not the record's fields (names and types).
pub fn bind<R: LaunchRecord>(kernel: &Kernel, record: &R) -> Result<Vec<i64>, String> {
    bind_params(&kernel.name, &kernel.params, record)
}

fn bind_params<R: LaunchRecord>(
    name: &str,
    params: &[(String, Ty)],
    record: &R,
) -> Result<Vec<i64>, String> {
    let expected = R::params();
    if params != expected {
        let names = |p: &[(String, Ty)]| {
            p.iter()
                .map(|(n, t)| format!("{n}: {t}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(format!(
            "kernel `{name}` takes ({}), the launch record has ({})",
            names(params),
            names(&expected)
        ));
    }
    Ok(record.values())
}

/// [`bind`] for a kernel that takes `maps` TMA tensor maps after the record's fields (which the
/// caller passes after the values): an error unless it takes exactly that many.
pub fn bind_with_maps<R: LaunchRecord>(
    kernel: &Kernel,
    record: &R,
    maps: usize,
) -> Result<Vec<i64>, String> {
    let n = kernel.params.len();
    let split = n.checked_sub(maps).filter(|&s| {
        kernel.params[s..].iter().all(|(_, t)| *t == Ty::TensorMap)
            && kernel.params[..s].iter().all(|(_, t)| *t != Ty::TensorMap)
    });
    let Some(split) = split else {
        return Err(format!(
            "kernel `{}` does not take {maps} tensor maps after its launch record",
            kernel.name
        ));
    };
    bind_params(&kernel.name, &kernel.params[..split], record)
}

/// Defines a launch record: a struct of i64 fields and its [`LaunchRecord`] impl.
macro_rules! launch_record {
    (
        $(#[$doc:meta])*
        $name:ident { $($(#[$field_doc:meta])* $field:ident: $kind:ident),* $(,)? }
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name {
            $($(#[$field_doc])* pub $field: i64,)*
        }

        impl $crate::gpu::launch::LaunchRecord for $name {
            const FIELDS: &'static [$crate::gpu::launch::Param] = &[
                $($crate::gpu::launch::Param {
                    name: stringify!($field),
                    kind: $crate::gpu::launch::ParamKind::$kind,
                },)*
            ];

            fn values(&self) -> Vec<i64> {
                vec![$(self.$field),*]
            }
        }
    };
}

pub(crate) use launch_record;

launch_record! {
    /// A forward launch (SIMT and tensor-core kernels): one CTA per (query block, head, batch).
    ForwardArgs {
        /// `[B, Hq, Sq, D]` queries in the kernel's input type.
        q: Address,
        /// `[B, Hkv, Skv, D]` keys.
        k: Address,
        /// `[B, Hkv, Skv, Dv]` values.
        v: Address,
        /// `[B, Hq, Sq, Dv]` f32 output.
        out: Address,
        /// `[B, Hq, Sq]` f32 log-sum-exp.
        lse: Address,
        /// One i32 tile code per (head, query block, key tile) (`crate::plan::TileCode`).
        codes: Address,
        /// Queries per sequence.
        sq: Scalar,
        /// Keys per sequence.
        skv: Scalar,
        /// The position of key 0.
        p0: Scalar,
        /// RoPE cosines, rows of `rope_dim / 2` f32 from position `rope_pos0`.
        rope_cos: Address,
        /// RoPE sines, as `rope_cos`.
        rope_sin: Address,
        /// The keys' RoPE cosines, as `rope_cos`: under xPos their factors are the inverse of
        /// the queries'; otherwise the same tables.
        rope_key_cos: Address,
        /// The keys' RoPE sines, as `rope_key_cos`.
        rope_key_sin: Address,
        /// The position of the tables' first row.
        rope_pos0: Scalar,
        /// The spec's parameters, f32, laid out as `crate::plan::ParamLayout` (0 without).
        params: Address,
    }
}

launch_record! {
    /// A decode launch: one CTA per task.
    DecodeArgs {
        /// Query rows, f32, `qk_dim` each.
        q_rows: Address,
        /// Task records (`decode::TASK_FIELDS` i64 each).
        tasks: Address,
        /// Segment records (`decode::SEGMENT_FIELDS` i64 each), K and V as device addresses or
        /// as offsets from `k_base` and `v_base`.
        segments: Address,
        /// Output rows, f32, `v_dim` each.
        out: Address,
        /// One f32 log-sum-exp per output row.
        lse: Address,
        /// RoPE cosines for the query positions.
        rope_cos: Address,
        /// RoPE sines.
        rope_sin: Address,
        /// The position of the tables' first row.
        rope_pos0: Scalar,
        /// Added to every segment record's key row address: the start of a cache whose
        /// records hold offsets into it (one table of records then serves every layer of a
        /// model), or 0 where records hold addresses.
        k_base: Address,
        /// Added to every segment record's value row address, as `k_base`.
        v_base: Address,
        /// The spec's parameters, as [`ForwardArgs::params`].
        params: Address,
    }
}

launch_record! {
    /// A backward launch, shared by its kernels (`backward_delta`, `backward_dq`,
    /// `backward_dkdv`, and `backward_dparams` for specs with parameters); every tensor f32
    /// and contiguous BHSD.
    BackwardArgs {
        /// `[B, Hq, Sq, D]` queries, before RoPE.
        q: Address,
        /// `[B, Hkv, Skv, D]` keys, before RoPE.
        k: Address,
        /// `[B, Hkv, Skv, Dv]` values.
        v: Address,
        /// `[B, Hq, Sq, Dv]` the forward's output.
        out: Address,
        /// `[B, Hq, Sq]` the forward's log-sum-exp.
        lse: Address,
        /// `[B, Hq, Sq, Dv]` the loss's gradient with respect to the output.
        dout: Address,
        /// `[B, Hq, Sq]` `D = rowsum(dout * out)`: written by `backward_delta`, read by the others.
        delta: Address,
        /// `[B, Hq, Sq, D]` output.
        dq: Address,
        /// `[B, Hkv, Skv, D]` output.
        dk: Address,
        /// `[B, Hkv, Skv, Dv]` output.
        dv: Address,
        /// Batch.
        batch: Scalar,
        /// Queries per sequence.
        sq: Scalar,
        /// Keys per sequence.
        skv: Scalar,
        /// The position of key 0.
        p0: Scalar,
        /// RoPE cosines, rows of `rope_dim / 2` f32 from position `rope_pos0`.
        rope_cos: Address,
        /// RoPE sines, as `rope_cos`.
        rope_sin: Address,
        /// The keys' RoPE cosines, as `rope_cos`: under xPos their factors are the inverse of
        /// the queries'; otherwise the same tables.
        rope_key_cos: Address,
        /// The keys' RoPE sines, as `rope_key_cos`.
        rope_key_sin: Address,
        /// The position of the tables' first row.
        rope_pos0: Scalar,
        /// The spec's parameters, as [`ForwardArgs::params`] (0 without).
        params: Address,
        /// `[param_copies, params]` f32: each `backward_dq` thread's own sums of the
        /// parameters' gradients, written by it alone (0 without parameters).
        param_partials: Address,
        /// Copies in `param_partials`: the `backward_dq` grid's threads (0 without parameters).
        param_copies: Scalar,
        /// The parameters' gradients, f32, laid out as `params`: the partials summed in copy
        /// order by `backward_dparams` (0 without parameters).
        dparams: Address,
        /// Values in `params`: the layout's and the call's data (0 without parameters).
        param_len: Scalar,
        /// `[B, Hq, Sq, ceil(Skv / 64), 2]` f32 under `normalize = stick_breaking`: each
        /// query row's running sums at each block of 64 keys, written by `backward_dq`, read
        /// by `backward_dkdv` (0 otherwise).
        stick_state: Address,
    }
}

launch_record! {
    /// A tensor-core backward launch, shared by its three kernels (`backward_tc_delta`,
    /// `backward_tc_dq`, `backward_tc_dkdv`): q, k, v and dout contiguous BHSD in the spec's
    /// 16-bit format, out, lse and the gradients f32.
    BackwardTcArgs {
        /// `[B, Hq, Sq, D]` queries, before RoPE.
        q: Address,
        /// `[B, Hkv, Skv, D]` keys, before RoPE.
        k: Address,
        /// `[B, Hkv, Skv, Dv]` values.
        v: Address,
        /// `[B, Hq, Sq, Dv]` the forward's output, f32.
        out: Address,
        /// `[B, Hq, Sq]` the forward's log-sum-exp, f32.
        lse: Address,
        /// `[B, Hq, Sq, Dv]` the loss's gradient with respect to the output.
        dout: Address,
        /// `[B, Hq, Sq]` f32 `D = rowsum(dout * out)`: written by `backward_tc_delta`.
        delta: Address,
        /// `[B, Hq, Sq, D]` f32 output.
        dq: Address,
        /// `[B, Hkv, Skv, D]` f32 output.
        dk: Address,
        /// `[B, Hkv, Skv, Dv]` f32 output.
        dv: Address,
        /// One i32 tile code per (query head, block of query rows, key tile) of the dq kernel.
        dq_codes: Address,
        /// One i32 tile code per (query head, block of keys, query tile) of the dk/dv kernel.
        dkdv_codes: Address,
        /// Batch.
        batch: Scalar,
        /// Queries per sequence.
        sq: Scalar,
        /// Keys per sequence.
        skv: Scalar,
        /// The position of key 0.
        p0: Scalar,
        /// RoPE cosines, rows of `rope_dim / 2` f32 from position `rope_pos0`.
        rope_cos: Address,
        /// RoPE sines, as `rope_cos`.
        rope_sin: Address,
        /// The keys' RoPE cosines, as `rope_cos`: under xPos their factors are the inverse of
        /// the queries'; otherwise the same tables.
        rope_key_cos: Address,
        /// The keys' RoPE sines, as `rope_key_cos`.
        rope_key_sin: Address,
        /// The position of the tables' first row.
        rope_pos0: Scalar,
    }
}
