use attn::attention;

#[attention(heads = 8, kv_heads = 2)]
struct Variant;

fn main() {}
