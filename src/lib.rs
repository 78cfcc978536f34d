//! attn: a compiler for attention variants.
//!
//! This facade re-exports the crates of the workspace:
//! - [`dsl`] (attn-dsl): the spec language, validation, accounting and the reference semantics;
//! - [`attention`] (attn-macros): `#[attention(...)]` on a struct;
//! - [`codegen`]: kernel plans and backends;
//! - [`runtime`] (attn-runtime): tensors, launches, caches and models; [`Attention`], the typed
//!   API of a declared variant.
//!
//! The `attnc` binary is the command-line front end.
//!
//! ```
//! let spec: attn::AttentionSpec = "heads = 8, kv_heads = 2, head_dim = 64, mask = causal"
//!     .parse()
//!     .unwrap();
//! assert_eq!(attn::dsl::accounting::kv_cache_bytes_per_token(&spec), 2 * 2 * 64 * 4);
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub use attn_dsl as dsl;
pub use attn_dsl::{AttentionSpec, DType, KvLayout, Mask, Position, Rope, RopeScaling};
pub use attn_macros::attention;
pub use attn_runtime as runtime;
pub use attn_runtime::Attention;
pub use codegen;
