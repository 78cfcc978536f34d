//! attn-runtime's tests, one module per subject: the backends (CPU and the GPU interpreter)
//! against the f64 reference for forward, decode and backward, learned parameters, extreme
//! scores, models against transformers' logits, hostile checkpoints, research models and text.
//! `support` holds input values and the `Backend` calls in the forms the tests read best.

mod backend;
mod broken_models;
mod cpu_backward;
mod cpu_differential;
mod data;
mod decode;
mod differential_heads;
mod distributed;
mod extreme_scores;
mod gpu_backward;
mod gpu_precision;
mod gpu_runtime;
mod learned;
mod model;
mod research;
mod resident_model;
mod stick_breaking;
mod support;
mod text;
mod varlen;
mod xpos;
