//! attn-dsl's tests, one module per subject: the spec language (parse, print, round trips,
//! learnable parameters), the modifier passes and their interval classification, the f64
//! reference against hand-computed cases and finite differences, the accounting, and IR
//! snapshots. `support` holds the proptest generators and the check of a refusal's span.

mod accounting;
mod data;
mod differential;
mod grad;
mod initial;
mod interval;
mod ir_snapshots;
mod learnable;
mod lets;
mod normalize;
mod parse;
mod program;
mod reference_backward;
mod reference_cases;
mod reference_learned;
mod rope;
mod roundtrip;
mod support;
mod xpos;
