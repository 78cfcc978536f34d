use attn::attention;

#[attention(heads = 32, kv_heads = 5, head_dim = 128)]
struct Variant;

fn main() {}
