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
mod rope;
mod score;
mod softmax;

pub(crate) use build::{Regs, param, special64};
pub(crate) use rope::{RopeWords, cos_sin, rope_params, rotate, rotate_pair};
pub(crate) use score::{Env, program};
pub(crate) use softmax::{exp2_twice, lse_of_half, reciprocal, rescale_to};
