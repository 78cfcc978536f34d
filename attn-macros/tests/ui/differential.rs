//! Differential heads pair the heads: an odd head count fails the build at the spec.

use attn_macros::attention;

#[attention(heads = 3, kv_heads = 3, head_dim = 16, differential = lambda)]
struct Paired;

fn main() {}
