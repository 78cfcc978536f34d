//! Differential heads combine two attentions per head: the trait's entry points cannot serve
//! them, and the build says where to go instead.

use attn_macros::attention;

#[attention(heads = 4, kv_heads = 2, head_dim = 16, differential = lambda)]
struct Paired;

fn main() {}
