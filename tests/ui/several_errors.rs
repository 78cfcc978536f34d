use attn::attention;

#[attention(
    heads = 8,
    head_dim = 64,
    kv_heads = 3,
    dtype = fp8,
)]
struct Variant;

fn main() {}
