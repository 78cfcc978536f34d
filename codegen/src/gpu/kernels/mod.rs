//! The kernels: each lowers a plan to GPU IR ([`crate::gpu::ir`]) as phases over shared
//! building blocks.

pub mod backward;
pub mod backward_tc;
pub mod decode;
pub mod forward;
pub mod forward_tc;
pub mod forward_wgmma;
pub mod layers;

mod build;
mod epilogue;
mod rope;
mod score;
mod softmax;
mod staging;
mod stick;

pub(crate) use build::{Regs, half_of, param, special64, tile_code};
pub(crate) use epilogue::epilogue;
pub(crate) use rope::{RopeWords, Side, cos_sin, rope_params, rotate, rotate_pair, table_names};
pub(crate) use score::{Env, TileScores, program, score_tile};
pub(crate) use softmax::{
    exp2_twice, lse_of_half, online_softmax, reciprocal, rescale_to, scale_folds, sigmoid_slope,
    sigmoid_weight,
};
pub(crate) use staging::{Staging, lane_aligned, stage_rows};
pub(crate) use stick::{StickKey, from_last};
