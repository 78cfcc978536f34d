//! The `attn` facade's tests: the golden PyTorch cases through the reference, the CPU and the
//! GPU interpreter (`reference_fixtures`, `cpu_fixtures`, `grad_fixtures`), the macro against
//! the string parser, kernels built ahead of time (`aot`), hostile specs and paths, the candle
//! op (`candle`, feature `candle`), and the tree's own rules (`tidy`).

mod aot;
mod candle;
mod cpu_fixtures;
mod fuzz_specs;
mod grad_fixtures;
mod hostile_paths;
mod macro_differential;
mod macro_spec;
mod reference_fixtures;
mod tidy;
