//! Host preparation every backend shares, as siblings of `cpu/` and `gpu/`: checks of a call's
//! tensors against its spec, RoPE tables, MLA's absorbed form, the layout of ragged batches, and
//! the work items of cached calls with the lse merge of their partitions. Tile classification
//! lives with the plan (`codegen::plan::TileCode`): every backend asks the plan.

pub(crate) mod checks;
pub(crate) mod gemm;
pub(crate) mod mla;
pub(crate) mod ragged;
pub(crate) mod rope_table;
pub(crate) mod work;
